"""Training: the loop that runs the step (`meshlm.train_step`) over the data, with validation, lm-eval tasks,
metrics, checkpoints, resume and a clean stop on SIGTERM. Where the run starts (datasets, the model, a LoRA
run's base) is `meshlm.run_start`'s; the optimizer is `meshlm.optim`'s, the throughput and noise-scale
accounting `meshlm.metrics`'.

With a `lora` section only a LoRA adapter trains (its gradients and optimizer state alone) over a frozen
base stored as `base_dtype`: float, int8 or NF4. The base is rebuilt, never saved: checkpoints hold the
adapter and its optimizer state, and record what the base was built from.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from meshlm import api, footprint, model, rollout, run_start
from meshlm.config import (
    RUN_CHECKPOINTS,
    ConfigError,
    Interrupted,
    TrainConfig,
    TrainingStopped,
    is_url,
)
from meshlm.data import Batch, TokenDataset
from meshlm.demo_corpus import DEMO_DATA
from meshlm.formats import native
from meshlm.loader import LoaderState, TrainLoader, eval_batches
from meshlm.lora import adapter_size, init_adapter
from meshlm.metrics import MetricsLog, NoiseScale, flops_per_token, peak_flops
from meshlm.objectives import OBJECTIVES
from meshlm.paths import as_path
from meshlm.sharding import describe, make_mesh
from meshlm.tokenizer import load_tokenizer
from meshlm.train_step import (
    ROW_TOKENS,
    StepProgram,
    TrainState,
    abstract_batch,
    batch_keys,
    check_batch,
    check_fits,
    eval_keys,
    frozen_model,
    make_eval_step,
    make_reference_step,
    out_of_memory,
    reference_in_step,
    rows_per_micro_batch,
    step_program,
)

# Runs a config's lm-eval tasks on a model: (lm, tasks, limit=, include_path=) -> {"task/metric": value}
Evaluator = Callable[..., dict[str, float]]


@dataclass
class TrainResult:
    out_dir: Path
    step: int
    losses: dict[int, float] = field(default_factory=dict)  # step -> training loss, this invocation's steps
    val_losses: dict[int, dict[str, float]] = field(default_factory=dict)
    stopped_by_signal: bool = False
    signal: int | None = None  # the signal that stopped the run (the command exits with 128 + it)
    lm: api.LanguageModel | None = None
    memory: footprint.Footprint | None = None  # the compiled step's memory per device


@contextmanager
def _stop_on_signals() -> Iterator[list[int]]:
    """SIGTERM/SIGINT set a flag instead of killing: start-up stops at its next stage, the loop saves a final
    checkpoint and returns. An exception raised at an arbitrary point would leave XLA compiling or running
    on its own threads while Python exits (a segfault). A second signal exits at once, saving nothing."""
    received: list[int] = []

    def handler(signum: int, _frame: Any) -> None:
        if received:
            print(f"\nmeshlm train: signal {signum} again: exiting now without saving", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(128 + signum)
        received.append(signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield received
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _place(local: dict[str, np.ndarray], spec: dict[str, jax.ShapeDtypeStruct]) -> dict[str, jax.Array]:
    """A batch's arrays from this process's rows, as global arrays laid out as `spec` says (its keys only)."""
    return {
        k: jax.make_array_from_process_local_data(s.sharding, np.asarray(local[k], s.dtype), s.shape)
        for k, s in spec.items()
    }


def train(
    cfg: TrainConfig, progress: bool = True, sample: bool = True, evaluate_tasks: Evaluator | None = None
) -> TrainResult:
    """Train (or resume, when `out_dir` holds checkpoints) until `total_steps` or a SIGTERM/SIGINT.

    `evaluate_tasks` runs the config's `eval_tasks` on the model every `eval_every` steps: the loop is handed
    an evaluator rather than importing one (`meshlm train` hands it lm-eval's, `meshlm.evaluate.evaluate_tasks`).

    Raises TrainingStopped when the loss turns non-finite or a checkpoint cannot be written (the last good
    checkpoint stays), and Interrupted for a signal that comes before the first step."""
    if cfg.eval_tasks and cfg.eval_every and evaluate_tasks is None:
        raise ConfigError(
            "eval_tasks are run by an evaluator handed to train(): train(cfg, evaluate_tasks="
            "meshlm.evaluate.evaluate_tasks), as `meshlm train` does"
        )
    out_dir = as_path(cfg.out_dir)  # a local folder, or a URL (gs://...) that checkpoints are written to
    with _stop_on_signals() as signals, _removed_if_refused([out_dir, Path(cfg.metrics_dir)]):
        _make_folder(out_dir, "out_dir")
        _make_folder(Path(cfg.metrics_dir), "log_dir")
        mesh = make_mesh(cfg.mesh)
        check_batch(cfg, mesh)
        train_ds, val_sets = run_start.open_datasets(cfg, out_dir, run_start.run_tokenizer(cfg, out_dir))
        _stop_if_signalled(signals)
        ckpts = native.TrainCheckpoints(out_dir / RUN_CHECKPOINTS, cfg.keep_last, cfg.keep_every)
        try:  # the manager's background threads must be stopped on every way out
            return _train(cfg, mesh, train_ds, val_sets, ckpts, progress, sample, signals, evaluate_tasks)
        finally:
            ckpts.close()


def _make_folder(path: Path, key: str) -> None:
    if not is_url(path) and path.exists() and not path.is_dir():
        raise ConfigError(f"{key} {path}: is a file, not a folder")
    path.mkdir(parents=True, exist_ok=True)


@contextmanager
def _removed_if_refused(folders: list[Path]) -> Iterator[None]:
    """A run refused (a ConfigError) before it saved a checkpoint or logged a step leaves no folder behind: the
    local folders it made (the outermost of each that did not exist) are removed again, and so are the empty
    folders it added to a folder that existed (orbax's checkpoints/). Nothing that was there before the run is
    touched, nor a file that appeared in such a folder meanwhile."""
    made, there = [], {}
    for folder in folders:
        if is_url(folder):
            continue
        if folder.is_dir():
            there[folder] = set(folder.iterdir())
            continue
        while not folder.parent.exists():
            folder = folder.parent
        made.append(folder)
    try:
        yield
    except ConfigError:
        empty = [entry for folder, old in there.items() for entry in set(folder.iterdir()) - old if _empty(entry)]
        if not any(_holds_results(path) for path in made):
            for path in dict.fromkeys(made + empty):
                shutil.rmtree(path, ignore_errors=True)
        raise


def _empty(path: Path) -> bool:
    """A folder (not a link to one) that holds folders at most."""
    return path.is_dir() and not path.is_symlink() and all(p.is_dir() for p in path.rglob("*"))


def _holds_results(path: Path) -> bool:
    """Whether a path is or holds what a run produced: a checkpoint, or a logged step."""
    for p in (path, *(path.rglob("*") if path.is_dir() and not path.is_symlink() else ())):
        if p.parent.name == RUN_CHECKPOINTS and p.name.isdigit():
            return True
        if p.name == "metrics.jsonl" and p.is_file() and p.stat().st_size:
            return True
    return False


def _stop_if_signalled(signals: list[int]) -> None:
    """Before the first step a signal stops the run between two stages of its start, with nothing to save."""
    if _any_process(bool(signals)):
        signum = signals[0] if signals else signal.SIGTERM
        raise Interrupted(f"stopped by signal {signum} before the first step; nothing was saved", signum)


def _train(
    cfg: TrainConfig,
    mesh: Mesh,
    train_ds: TokenDataset,
    val_sets: dict[str, TokenDataset],
    ckpts: native.TrainCheckpoints,
    progress: bool,
    sample: bool,
    signals: list[int],
    evaluate_tasks: Evaluator | None,
) -> TrainResult:
    run, step_fn, seq_len, used = start_run(cfg, mesh, train_ds, val_sets, ckpts, progress, signals)
    cfg = run.cfg
    result = TrainResult(run.out_dir, run.step, memory=used)
    log = StepLog(cfg, mesh, seq_len, run, result, progress)
    examples = {"preference": "pairs", "prompts": "prompts"}.get(OBJECTIVES[cfg.objective].data, "sequences")
    run.show(f"meshlm train: {run.describe()} on {describe(mesh)}; {len(train_ds):,} train {examples}")

    first = step = run.step
    pending = None
    with jax.set_mesh(mesh), log:
        # a run stops between batches of rollouts (each trains `steps_per_batch` steps): it saves no rollouts
        while step < cfg.total_steps and not (step % run.steps_per_batch == 0 and _any_process(bool(signals))):
            batch, rollout_metrics = run.next_batch(step)
            run.state, metrics = step_fn(run.state, batch, *run.frozen_args)
            metrics |= rollout_metrics
            step += 1
            ckpts.check()  # a background save that failed stops the run now, not at the next save
            if pending:  # a step's metrics are read once the next step is queued: the devices never wait
                log.record(*pending)
            pending = (step, metrics)
            validate_now = bool(cfg.val_every and step % cfg.val_every == 0)
            evaluate_now = bool(cfg.eval_tasks and cfg.eval_every and step % cfg.eval_every == 0)
            save_now = bool(cfg.ckpt_every and step % cfg.ckpt_every == 0)
            if validate_now or evaluate_now or save_now:
                log.record(*pending)
                pending = None
                if validate_now and val_sets:
                    log.write(step, run.validate(), result.val_losses)
                if evaluate_now:
                    log.write(step, run.evaluate_tasks(evaluate_tasks))
                if save_now:
                    run.save(step)
                log.restart_clock()  # throughput counts training only
        if pending:
            log.record(*pending)
        if step != run.last_saved:
            run.save(step)
        ckpts.wait()
    result.step = step
    result.stopped_by_signal = step < cfg.total_steps
    if result.stopped_by_signal:
        result.signal = signals[0] if signals else signal.SIGTERM
        why = f"signal {signals[0]}" if signals else "a signal to another process"
        saved = f"checkpoint saved in {ckpts.folder}" if step > first else "no new step to save"
        run.show(f"meshlm train: stopped by {why} at step {step}; {saved}")
    result.lm = run.language_model()
    demo = cfg.data is None or cfg.data in DEMO_DATA
    if sample and cfg.sample_tokens and not signals and demo and jax.process_count() == 1:
        penalty = 1.2 if cfg.data is None else 1.0
        print_sample(result.lm, cfg.sample_prompt, cfg.sample_tokens, repetition_penalty=penalty)
    return result


def start_run(
    cfg: TrainConfig,
    mesh: Mesh,
    train_ds: TokenDataset,
    val_sets: dict[str, TokenDataset],
    ckpts: native.TrainCheckpoints,
    progress: bool = False,
    signals: list[int] | None = None,
) -> tuple[Run, Any, int, footprint.Footprint]:
    """What a run does before its first step: where it starts (`run_start.resolve`), its step compiled, its state
    on the devices (with a GRPO run's engine) and a full DPO run's reference log-probs. Returns the run, its
    compiled step (`step_fn(run.state, batch, *run.frozen_args)`), the step's seq_len and its memory per device.
    A signal among `signals` stops the start between two stages (`train`'s loop is one caller; a benchmark that
    times the steps itself, benchmarks/grpo_step.py, another)."""
    stop = lambda: _stop_if_signalled(signals or [])
    start = run_start.resolve(cfg, ckpts, train_ds, val_sets, mesh)
    cfg = start.cfg
    seq_len = rollout.step_seq_len(cfg, train_ds.seq_len) if cfg.objective == "grpo" else train_ds.seq_len
    program, step_fn, used = compile_step(cfg, mesh, seq_len)
    stop()
    run = Run(cfg, mesh, program, start, ckpts, train_ds, val_sets)
    jax.block_until_ready(run.state)  # nothing in flight when a signal stops the run here
    stop()
    run.prepare_reference(progress, stop)
    return run, step_fn, seq_len, used


def compile_step(cfg: TrainConfig, mesh: Mesh, seq_len: int) -> tuple[StepProgram, Any, footprint.Footprint]:
    """The run's step, compiled and checked against the devices' memory before any weights are read."""
    program = step_program(cfg, cfg.model, mesh, seq_len)
    began = time.perf_counter()
    try:
        compiled = program.compile()
    except footprint.OutOfMemory as e:
        raise footprint.OutOfMemory(out_of_memory(cfg, mesh, e.needed, e.capacity), e.needed, e.capacity) from None
    used = check_fits(compiled, mesh, cfg)
    if jax.process_index() == 0:
        print(
            f"meshlm train: step compiled in {time.perf_counter() - began:.1f} s; it needs "
            f"{footprint.gib(used.total)} per device"
        )
    return program, compiled, used


class Run:
    """A run's state on the devices and what it does besides stepping: build or restore the state,
    validate, evaluate, save, and present the trained model."""

    def __init__(
        self,
        cfg: TrainConfig,
        mesh: Mesh,
        program: StepProgram,
        start: run_start.Start,
        ckpts: native.TrainCheckpoints,
        train_ds: TokenDataset,
        val_sets: dict[str, TokenDataset],
    ):
        self.cfg, self.mesh, self.ckpts, self.val_sets, self.out_dir = cfg, mesh, ckpts, val_sets, as_path(cfg.out_dir)
        self.program, self.train_ds, self.resumed = program, train_ds, start.latest is not None
        self.base_ref = start.base_ref
        self.base_lm = None if start.base_ref is None else run_start.load_base(start.base_ref, cfg.model, mesh, cfg)
        self.frozen = None if self.base_lm is None else jax.device_put(self.base_lm.params, program.frozen_shardings)
        # a full DPO run's starting weights, by `weights_fingerprint`: what its reference is, recorded in its
        # checkpoints, so that a resume that rebuilds the reference knows it for the same model
        self.starting_weights: str | None = None
        self.state, loader_state, self.step = self._initial_state(program, start)
        reference = OBJECTIVES[cfg.objective].reference or frozen_model(cfg) == "reference"
        if reference and cfg.lora is None and not self.resumed:
            self.starting_weights = run_start.weights_fingerprint(self.state.params, mesh)
        if frozen_model(cfg) == "reference":
            self.frozen = self._reference_model(copy=True)
        self.reference: dict[str, np.ndarray] | None = None  # precomputed reference log-probs (`prepare_reference`)
        self.last_saved = self.step
        process, processes = jax.process_index(), jax.process_count()
        # GRPO's loader reads prompts, each sampled num_generations times
        examples, micro = (
            (rollout.prompts_per_step(cfg), 1) if cfg.objective == "grpo" else (cfg.batch_size, cfg.micro_batches)
        )
        self.loader = TrainLoader(train_ds, examples, micro, cfg.seed, process, processes, loader_state)
        self.eval_fn = make_eval_step(cfg, cfg.model, mesh)
        self.main = jax.process_index() == 0  # only process 0 prints
        self.rollouts: rollout.Rollouts | None = None
        self.rollout: rollout.Rollout | None = None  # the batch of rollouts the steps train on now (GRPO)
        if cfg.objective == "grpo":
            weights = self.state.params if cfg.lora is None else self.frozen
            tokenizer = load_tokenizer(None, self.out_dir)
            self.rollouts = rollout.Rollouts(cfg, mesh, train_ds, val_sets, weights, tokenizer)

    @property
    def steps_per_batch(self) -> int:
        """Steps one batch of the loader feeds: GRPO trains `num_iterations` steps on each batch of rollouts."""
        return self.cfg.grpo.num_iterations if self.rollouts is not None else 1

    def next_batch(self, step: int) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
        """The batch of step `step` + 1, laid out over the mesh, and the metrics of its making: a GRPO run's
        rollouts, made anew every `steps_per_batch` steps, with their rewards (logged with their first step), and
        every `log_completions_every` steps their completions to the run's log folder."""
        if self.rollouts is None:
            return self.batch(next(self.loader)), {}
        metrics = {}
        if step % self.steps_per_batch == 0:
            # the KL's reference (beta > 0): the frozen starting model, or a LoRA run's base with the adapter off
            self.rollout = self.rollouts.make(self.state.params, self.full(), self.frozen, next(self.loader), step)
            metrics = self.rollout.metrics
        every = self.cfg.grpo.log_completions_every
        if every and (step + 1) % every == 0 and self.main:
            rollout.write_table(Path(self.cfg.metrics_dir), step + 1, self.rollout.table)
        return _place(self.rollout.batch, self.program.inputs[1]), metrics

    def _initial_state(self, program: StepProgram, start: run_start.Start) -> tuple[TrainState, LoaderState, int]:
        cfg, shardings = self.cfg, program.shardings
        with jax.set_mesh(self.mesh):
            if start.latest is not None:
                target = program.inputs[0]
                params, opt_state, desc = self.ckpts.restore(start.latest, target.params, target.opt_state)
                self.starting_weights = desc.get("starting_weights")  # None: a checkpoint from before it was recorded
                step = jax.device_put(jnp.asarray(start.latest, jnp.int32), shardings.step)
                return TrainState(step, params, opt_state), LoaderState.from_dict(desc["loader"]), start.latest
            if cfg.lora is not None:
                key = jax.random.fold_in(jax.random.key(cfg.seed), ADAPTER_KEY)
                init = lambda k: init_adapter(model.projections(cfg.model), cfg.lora, k, cfg.param_dtype)
                params = jax.jit(init, out_shardings=shardings.params)(key)
            else:
                params = self._starting_model()
            opt_state = jax.jit(program.optimizer.init, out_shardings=shardings.opt_state)(params)
            first = 0
            if start.seed_opt is not None:  # a seed run continued: its moments, count and step
                opt_state = jax.device_put(start.seed_opt.into(opt_state), shardings.opt_state)
                first = start.seed_opt.step
            step = jax.device_put(jnp.asarray(first, jnp.int32), shardings.step)
            return TrainState(step, params, opt_state), LoaderState(), first

    def _starting_model(self) -> model.Params:
        """A full run's model at step 0: `init_from`'s weights, else the random model of the seed."""
        cfg, shardings = self.cfg, self.program.shardings
        if cfg.init_from:
            lm = api.load(cfg.init_from, mesh=self.mesh, dtype=cfg.param_dtype, seed_config=cfg.seed_config)
            return jax.device_put(lm.params, shardings.params)
        init = lambda k: model.init(cfg.model, k, cfg.param_dtype)
        return jax.jit(init, out_shardings=shardings.params)(jax.random.key(cfg.seed))

    def _reference_model(self, copy: bool) -> model.Params:
        """A full DPO or GRPO run's reference, its starting model: before the first step the state's own parameters
        (a `copy` where they must outlive the step, which donates them), on resume rebuilt as they were."""
        if self.resumed:
            with jax.set_mesh(self.mesh):
                params = self._starting_model()
            if self.starting_weights not in (None, run_start.weights_fingerprint(params, self.mesh)):
                raise ConfigError(
                    f"init_from {self.cfg.init_from}: not the starting model the run's checkpoints were trained "
                    "from (its weights changed since), so the run's reference (DPO's, GRPO's) cannot be rebuilt; "
                    "restore that model, or train in a new out_dir"
                )
            return params
        if not copy:
            return self.state.params
        return jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=self.program.shardings.params)(
            self.state.params
        )

    def prepare_reference(self, progress: bool, stop: Callable[[], None]) -> None:
        """A full DPO run's reference log-probs (`dpo.reference: precompute`) of every row of its datasets:
        those stored beside the run, or computed from the starting model before the first step, in one
        jitted pass over each dataset, and stored there. `stop()` runs between batches: a signal ends the pass."""
        if "reference" not in batch_keys(self.cfg):
            return
        cfg = self.cfg
        datasets = {"train": self.train_ds, **{f"val/{name}": ds for name, ds in self.val_sets.items()}}
        identity = run_start.reference_identity(cfg, datasets, self.starting_weights)
        self.reference = run_start.read_reference_logps(self.out_dir, identity, self.resumed, self.notice)
        if self.reference is not None:
            return
        began, params = time.perf_counter(), self._reference_model(copy=False)
        fn = make_reference_step(cfg, cfg.model, self.mesh)
        self.reference = {
            name: self._reference_logps(fn, params, name, ds, progress, stop) for name, ds in datasets.items()
        }
        if self.main:
            path = run_start.write_reference_logps(self.out_dir, identity, self.reference)
            rows = sum(len(v) for v in self.reference.values())
            self.show(
                f"meshlm train: reference log-probs of {rows:,} rows computed in {time.perf_counter() - began:.1f} s; "
                f"stored in {path}"
            )

    def _reference_logps(
        self, fn: Callable[..., Any], params: model.Params, name: str, ds: TokenDataset, progress: bool, stop: Callable
    ) -> np.ndarray:
        """The reference log-prob of each row of `ds`, by row id, a micro-batch of rows at a time."""
        from tqdm import tqdm

        cfg = self.cfg
        spec = abstract_batch(self.mesh, (*ROW_TOKENS, "rows"), (rows_per_micro_batch(cfg),), ds.seq_len)
        values = np.full(ds.rows, np.nan, np.float32)
        n = -(-len(ds) // cfg.micro_batch_size)
        batches = eval_batches(ds, cfg.micro_batch_size, n, jax.process_index(), jax.process_count())
        bar = tqdm(batches, total=n, desc=f"reference log-probs ({name})", disable=not (progress and self.main))
        for batch, examples in bar:
            stop()
            rows = np.where(examples > 0, batch.rows, -1)  # a row that only pads the last batch is dropped
            logps, ids = (_local(x) for x in fn(params, _place({**batch._asdict(), "rows": rows}, spec)))
            values[ids[ids >= 0]] = logps[ids >= 0]
        assert not np.isnan(values).any(), f"{ds.folder}: the pass left rows without a reference log-prob"
        return values

    @property
    def frozen_args(self) -> tuple[model.Params, ...]:
        """The step's arguments after the batch: its frozen model, where it has one (`frozen_model`)."""
        return () if self.frozen is None else (self.frozen,)

    def _arrays(self, batch: Batch, name: str) -> dict[str, np.ndarray]:
        """A batch's arrays by name, with its rows' reference log-probs where the run precomputed them."""
        arrays = batch._asdict()
        if self.reference is not None:
            arrays["reference"] = self.reference[name][batch.rows]
        return arrays

    def batch(self, batch: Batch) -> dict[str, jax.Array]:
        """The step's batch: the loader's rows of this process, laid out over the mesh."""
        return _place(self._arrays(batch, "train"), self.program.inputs[1])

    def full(self) -> model.Params:
        """The model the trained parameters are part of: themselves, or the base with them as its adapter."""
        return self.state.params if self.cfg.lora is None else {**self.frozen, "lora": self.state.params}

    def language_model(self) -> api.LanguageModel:
        cfg = self.cfg
        if self.base_lm is None:
            return api.LanguageModel(cfg.model, self.state.params, self.mesh, cfg.param_dtype, folder=self.out_dir)
        lm = self.base_lm
        return api.LanguageModel(
            cfg.model, self.full(), self.mesh, lm.dtype, folder=self.out_dir, quantized=lm.quantized
        )

    def describe(self) -> str:
        cfg, what = self.cfg, f"{model.count_params(self.cfg.model):,} params"
        if cfg.lora is None:
            return what
        trainable = adapter_size(model.projections(cfg.model), cfg.lora)
        targets = ", ".join(cfg.lora.targets)
        return (
            f"LoRA rank {cfg.lora.rank} on {targets}: {trainable:,} trainable of {what}; base {self.base_ref['dtype']}"
        )

    def save(self, step: int) -> None:
        """A checkpoint; a LoRA run's holds the adapter alone, with its settings and the base it adapts."""
        cfg = self.cfg
        if not bool(_all_finite(self.state.params)):
            raise TrainingStopped(
                f"step {step}: the parameters are no longer finite; stopped without saving them, "
                f"{self.last_good()} (lower lr, or check the data)"
            )
        extra = {} if cfg.lora is None else {"lora": cfg.lora.to_dict(), "base": self.base_ref}
        if self.starting_weights is not None:
            extra["starting_weights"] = self.starting_weights
        loader = self.loader.state.to_dict()
        desc = native.description(
            cfg.model, self.state.params, step=step, loader=loader, train_config=_jsonable(cfg), **extra
        )
        self.ckpts.save(step, self.state.params, self.state.opt_state, desc)
        self.last_saved = step

    def last_good(self) -> str:
        """Which checkpoint a stopped run leaves to resume from."""
        if self.ckpts.latest_step() is None:
            return "and no checkpoint was saved"
        return f"the last checkpoint, step {self.last_saved}, is intact"

    def validate(self) -> dict[str, float]:
        """The objective on each validation set's first `val_batches` batches: its mean loss (per token, or
        per pair) as `val/<name>`, and its other metrics (trl's, for preference data) as `val/<name>/<metric>`;
        for GRPO, the rewards of completions of its prompts (`Rollouts.validate`)."""
        cfg, values = self.cfg, {}
        if self.rollouts is not None:
            return self.rollouts.validate(self.state.params)
        for name, ds in self.val_sets.items():
            spec = abstract_batch(self.mesh, eval_keys(cfg), (rows_per_micro_batch(cfg),), ds.seq_len)
            sums: dict[str, float] = {}
            count = 0.0
            for batch, examples in eval_batches(
                ds, cfg.micro_batch_size, cfg.val_batches, jax.process_index(), jax.process_count()
            ):
                arrays = {**self._arrays(batch, f"val/{name}"), "examples": examples}
                result = self.eval_fn(self.state.params, self.frozen, _place(arrays, spec))
                n = _scalar(result.count)
                count += n
                for key, value in result.metrics.items():
                    sums[key] = sums.get(key, 0.0) + n * _scalar(value)
            for key in sorted(sums, key=lambda k: k != "loss"):  # the loss first
                values[f"val/{name}" if key == "loss" else f"val/{name}/{key}"] = sums[key] / count
        return values

    def evaluate_tasks(self, evaluator: Evaluator) -> dict[str, float]:
        cfg = self.cfg
        scores = evaluator(
            self.language_model(), cfg.eval_tasks, limit=cfg.eval_limit, include_path=cfg.eval_include_path
        )
        return {f"eval/{k}": v for k, v in scores.items()}

    def show(self, line: str) -> None:
        if self.main:
            print(line)

    def notice(self, line: str) -> None:
        """Something the run does otherwise than asked or than last time, and why (on stderr)."""
        if self.main:
            print(f"meshlm train: {line}", file=sys.stderr, flush=True)


class StepLog:
    """Each step's metrics with throughput, MFU and the noise scale: to the metrics log, the progress bar
    and, every `log_every` steps, a line on the console (process 0)."""

    def __init__(self, cfg: TrainConfig, mesh: Mesh, seq_len: int, run: Run, result: TrainResult, progress: bool):
        from tqdm import tqdm

        self.cfg, self.result, self.run = cfg, result, run
        self.tokens_per_step = cfg.micro_batches * rows_per_micro_batch(cfg) * seq_len
        per_token = flops_per_token(cfg.model, seq_len, cfg.lora, reference_in_step(cfg))
        self.flops_per_step = per_token * self.tokens_per_step
        self.peak = peak_flops(mesh, cfg.compute_dtype)
        self.noise = NoiseScale(cfg.micro_batch_size, cfg.batch_size, cfg.noise_scale_alpha)
        resumed = run.step if run.ckpts.latest_step() is not None else None
        self.log = MetricsLog(Path(cfg.metrics_dir), cfg.wandb_project, cfg.wandb_run, _jsonable(cfg), resumed)
        self.say = tqdm.write if run.main else lambda *_: None
        self.bar = tqdm(
            total=cfg.total_steps, initial=run.step, desc="train", unit="step", disable=not (progress and run.main)
        )
        self.restart_clock()

    def restart_clock(self) -> None:
        self.last_time = time.perf_counter()

    def record(self, step: int, metrics: dict[str, jax.Array]) -> None:
        values = {k: _scalar(v) for k, v in metrics.items()}
        if not (np.isfinite(values["loss"]) and np.isfinite(values["grad_norm"])):
            raise TrainingStopped(
                f"step {step}: the loss is {values['loss']} (grad norm {values['grad_norm']}); stopped without "
                f"saving, {self.run.last_good()} (lower lr, or check the data)"
            )
        now = time.perf_counter()
        dt, self.last_time = now - self.last_time, now
        values["tokens_per_s"] = self.tokens_per_step / dt
        values["mfu"] = self.flops_per_step / dt / self.peak
        values |= self.noise.update(values.pop("micro_grad_sq"), values["grad_norm"])
        self.result.losses[step] = values["loss"]
        self.log.write(step, values)
        self.bar.set_postfix(loss=f"{values['loss']:.3f}", lr=f"{values['lr']:.2e}")
        self.bar.update(1)
        if step % self.cfg.log_every == 0:
            rewards = ""
            if "rewards/margins" in values:  # a preference objective: what it is learning, beside its loss
                margin, accuracy = values["rewards/margins"], values["rewards/accuracies"]
                rewards = f", reward margin {margin:.3f}, accuracy {accuracy:.2f}"
            if "reward" in values:  # GRPO, on a step that made rollouts: their mean reward
                rewards = f", reward {values['reward']:.3f}"
            self.say(
                f"step {step}: loss {values['loss']:.4f}{rewards}, lr {values['lr']:.3e}, grad norm "
                f"{values['grad_norm']:.3f}, {values['tokens_per_s']:,.0f} tokens/s, MFU {values['mfu']:.1%}"
            )

    def write(self, step: int, values: dict[str, float], into: dict[int, dict[str, float]] | None = None) -> None:
        """Validation or evaluation results: logged and printed (and kept `into` the result)."""
        if into is not None:
            into[step] = values
        self.log.write(step, values)
        self.say(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in values.items()))

    def close(self) -> None:
        self.bar.close()
        self.log.close()

    def __enter__(self) -> StepLog:
        return self

    def __exit__(self, error_type: type | None, *_: object) -> None:
        self.bar.leave = error_type is None  # an error's one line is not left behind a stale progress bar
        self.close()


ADAPTER_KEY = 2**32 - 1  # folded into the seed's key for a new adapter: apart from the base's and dropout's keys


@jax.jit
def _all_finite(tree: Any) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(tree)]))


def _local(x: jax.Array) -> np.ndarray:
    """A replicated array's value, read from this process's own copy (works across hosts)."""
    return np.asarray(x.addressable_data(0))


def _scalar(x: jax.Array) -> float:
    return float(_local(x))


def _any_process(flag: bool) -> bool:
    """True on every process when any process has it: a signal to one host stops all of them together."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))


def _jsonable(cfg: TrainConfig) -> dict[str, Any]:
    return json.loads(json.dumps(cfg.to_dict()))


def print_sample(lm: api.LanguageModel, prompt: str, n: int, repetition_penalty: float = 1.2) -> None:
    """A greedy sample; the text demo's small model loops without a repetition penalty, a chat model's answer
    repeats the question's words and must not be penalised for it."""
    (text,) = lm.generate([prompt], max_new_tokens=n, temperature=0.0, repetition_penalty=repetition_penalty)
    penalty = f", repetition penalty {repetition_penalty:g}" if repetition_penalty != 1.0 else ""
    print(f"sample (greedy{penalty}): {prompt + text!r}")
