"""Where a training run starts: its config file (meshlm's or the seed's), its tokenizer and datasets (of the
kind its objective trains on), the model it trains (its own latest checkpoint, else `init_from`'s config, else
the config's), a LoRA run's frozen base, a seed run's optimizer state to continue, and a full DPO run's
precomputed reference log-probs. Every check here needs no weights, so a run that cannot start says so before
compiling or loading anything."""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshlm import api
from meshlm.config import ConfigError, LoraConfig, ModelConfig, TrainConfig, apply_overrides, one_line
from meshlm.data import TokenDataset
from meshlm.demo_corpus import DEMO_DATA, prepare_demo_corpus, prepare_demo_records
from meshlm.formats import native, registry
from meshlm.formats.mtj_config import from_seed_config, is_seed_config
from meshlm.formats.slices import OptimizerState
from meshlm.lora import base_storage
from meshlm.objectives import OBJECTIVES
from meshlm.tokenizer import HFTokenizer, Tokenizer, copy_files, model_tokenizer_json, tokenizer_files


def load_train_config(
    path: str | Path | None = None, overrides: list[str] = (), values: dict[str, Any] | None = None
) -> TrainConfig:
    """Read a YAML/JSON config (meshlm's or the seed's), apply `key=value` overrides, then the already
    typed `values` (the command line's flags, which win), validate."""
    read: dict[str, Any] = {}
    if path is not None:
        import yaml

        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"config file {path} not found") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not a text file in UTF-8 (byte {e.start}); expected YAML or JSON") from None
        try:
            read = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        except (json.JSONDecodeError, yaml.YAMLError) as e:
            raise ConfigError(f"{path}: cannot parse ({one_line(e)})") from None
        if not isinstance(read, dict):
            raise ConfigError(f"{path}: expected a mapping of config keys at the top level")
        if is_seed_config(read):
            read = from_seed_config(read)
    return TrainConfig.from_dict({**apply_overrides(read, list(overrides)), **(values or {})})


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
    if cfg.data in DEMO_DATA:
        folder = prepare_demo_records(out_dir / "data", cfg.data, cfg.seq_len or 128, tokenizer)
        train_ds, val = TokenDataset(folder, "train"), TokenDataset(folder, "val")
        check_kind(cfg, train_ds)
        return train_ds, {"val": val}
    if cfg.data is None:
        if OBJECTIVES[cfg.objective].data == "prompts":
            raise ConfigError(
                f"objective {cfg.objective} trains on prompts: set data to a folder `meshlm prepare --objective grpo` "
                'made from {"prompt"} records, or to the built-in demo:prompts'
            )
        if OBJECTIVES[cfg.objective].data != "lm":
            raise ConfigError(
                f"objective {cfg.objective} trains on preference pairs: set data to a folder `meshlm prepare` made "
                'from {"prompt", "chosen", "rejected"} records, or to the built-in demo:pairs'
            )

        folder = prepare_demo_corpus(out_dir / "data", cfg.seq_len or 128, tokenizer)
        return TokenDataset(folder, "train"), {"val": TokenDataset(folder, "val")}
    if not Path(cfg.data).exists():
        builtin = f" (the built-in data sets are {', '.join(DEMO_DATA)})" if cfg.data.startswith("demo:") else ""
        raise ConfigError(f"data folder {cfg.data} does not exist; create it with `meshlm prepare`{builtin}")
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
        check_kind(cfg, ds)
        if tokenizer is not None and ds.eos_id != tokenizer.eot_id:
            raise ConfigError(
                f"{ds.folder}: prepared with end-of-text id {ds.eos_id}, but the model's tokenizer ({tokenizer.name}) "
                f"has {tokenizer.eot_id}; prepare the data with `meshlm prepare --tokenizer {cfg.init_from or out_dir}`"
            )
    return train_ds, vals


def check_kind(cfg: TrainConfig, ds: TokenDataset) -> None:
    """Refuse data of the other kind than the objective trains on: text for lm, preference pairs for dpo and orpo;
    warn of pairs tokenized for the other preference objective (trl tokenizes DPO's and ORPO's pairs differently)."""
    if ds.kind == OBJECTIVES[cfg.objective].data:
        if ds.objective not in (None, cfg.objective) and jax.process_index() == 0:
            print(
                f"meshlm train: warning: {ds.folder} holds pairs tokenized for {ds.objective}, trained with "
                f"{cfg.objective}; `meshlm prepare --objective {cfg.objective}` tokenizes them as trl does for it",
                file=sys.stderr,
            )
        return
    if ds.kind == "prompts":
        raise ConfigError(
            f"{ds.folder}: split {ds.split!r} holds prompts for reinforcement learning (objective grpo), but "
            f"objective is {cfg.objective}"
        )
    if ds.kind == "preference":
        raise ConfigError(
            f"{ds.folder}: split {ds.split!r} holds preference pairs, but objective is {cfg.objective}; "
            "train on pairs with objective dpo or orpo"
        )
    raise ConfigError(
        f"{ds.folder}: split {ds.split!r} holds text, not the preference pairs objective {cfg.objective} trains on; "
        'prepare a dataset from {"prompt", "chosen", "rejected"} records'
    )


def _splits(folder: str) -> list[str]:
    from meshlm.data import read_index

    return list(read_index(folder)["splits"])


class Start(NamedTuple):
    """Where a run starts: its config with the model (and a LoRA run's base) resolved, the checkpoint step it
    resumes from (None: a fresh run), the base it adapts, and a seed run's optimizer state to continue."""

    cfg: TrainConfig
    latest: int | None
    base_ref: dict[str, Any] | None
    seed_opt: OptimizerState | None


def resolve(
    cfg: TrainConfig,
    ckpts: native.TrainCheckpoints,
    train_ds: TokenDataset,
    val_sets: dict[str, TokenDataset],
    mesh: Mesh,
) -> Start:
    """The model the run trains, from its own latest checkpoint, else `init_from`'s config, else the
    config's; every check that needs no weights. The run's checkpoints come first, also in a run that
    continued a seed run."""
    if cfg.lora is not None and cfg.resume_optimizer:
        raise ConfigError(
            "resume_optimizer continues a full seed run's Adam state; a LoRA run trains a new adapter with a new "
            "optimizer (drop one of the two)"
        )
    latest, seed_opt, model_cfg = ckpts.latest_step(), None, cfg.model
    base_ref = base_reference(cfg) if cfg.lora is not None else None
    if latest is not None:
        desc = native.read_description(ckpts.folder / str(latest))
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
    if cfg.objective == "grpo" and train_ds.seq_len + 1 + cfg.grpo.max_completion_tokens > model_cfg.max_seq_len:
        raise ConfigError(
            f"grpo.max_completion_tokens {cfg.grpo.max_completion_tokens}: after prompts of up to "
            f"{train_ds.seq_len + 1} tokens (the data's rows) a completion would pass the model's max_seq_len "
            f"{model_cfg.max_seq_len}"
        )
    if train_ds.eos_id >= model_cfg.vocab_size:
        raise ConfigError(
            f"the data's end-of-text id is {train_ds.eos_id}, beyond the model's vocab_size {model_cfg.vocab_size}; "
            "the data was tokenized for another vocabulary"
        )
    for ds in (train_ds, *val_sets.values()):
        ds.check_vocab(model_cfg.vocab_size)
    return Start(cfg.replace(model=model_cfg), latest, base_ref, seed_opt)


def base_reference(cfg: TrainConfig) -> dict[str, Any]:
    """What a LoRA run's frozen base is built from, as its checkpoints record it so that a resume rebuilds
    the same base: `init_from` as an absolute path (a run folder resolved to its latest step, which would
    otherwise move on), else the random model of `seed`; `dtype` is how the base is stored."""

    def absolute(path: str | None) -> str | None:
        return None if path is None else str(Path(native.resolve(path)).absolute())

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


def load_seed_optimizer(cfg: TrainConfig, mesh: Mesh) -> OptimizerState:
    """Adam's state and the step of the full seed checkpoint `cfg.init_from`, which the run then continues.

    `total_steps` counts from the seed run's start, as in the seed's own config, so it must exceed the
    checkpoint's step.
    """
    read = registry.optimizer_reader(cfg.init_from)
    if read is None:
        raise ConfigError(
            f"resume_optimizer: {cfg.init_from} is not a seed checkpoint; only a full seed (mesh-transformer-jax) "
            "checkpoint carries Adam's moments to resume"
        )
    # Moments take adam_dtype (float32 with resume_optimizer, as the seed stored them), whatever the weights' dtype.
    seed = read(cfg.init_from, mesh, cfg.adam_dtype, cfg.seed_config)
    if seed.step >= cfg.total_steps:
        raise ConfigError(
            f"resume_optimizer: {cfg.init_from} is at step {seed.step}, total_steps is {cfg.total_steps}; "
            "total_steps counts from the seed run's start, so set it above the checkpoint's step"
        )
    return seed


# A full DPO run's reference log-probs (`dpo.reference: precompute`), stored beside its checkpoints.
REFERENCE_LOGPS = "reference_logps.npz"


def reference_identity(cfg: TrainConfig, datasets: dict[str, TokenDataset], weights: str | None) -> dict[str, Any]:
    """What precomputed reference log-probs are of: the starting model (`init_from`'s weights, else the
    random model of the seed, run in the config's dtypes; `weights` the `weights_fingerprint` of its values,
    None where it is not known) and each dataset (`dataset_identity`)."""
    start = base_reference(cfg)
    starting_model = {
        "init_from": start["init_from"],
        "seed": start["seed"],
        "param_dtype": cfg.param_dtype,
        "compute_dtype": cfg.compute_dtype,
        "model": cfg.model.to_dict(),
        "weights": weights,
    }
    return {"model": starting_model, "datasets": {name: dataset_identity(ds) for name, ds in datasets.items()}}


def weights_fingerprint(params: Any, mesh: Mesh) -> str:
    """A digest of parameter values that is cheap (one pass on the devices, where they lie) and the same on
    every mesh: each leaf's bits, as unsigned integers, are summed with weights that depend on their position,
    twice with different weights, in uint32 arithmetic, which is exact, so the sums do not depend on how
    the leaf is split over devices nor in which order its parts are added. sha256 then joins each leaf's
    name, shape, dtype and sums. A model saved again with other values (retrained, converted over) differs."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    replicated = NamedSharding(mesh, PartitionSpec())  # read from each process's own copy, on any number of hosts
    sums = jax.jit(_leaf_sums, out_shardings=replicated)([leaf for _, leaf in leaves])
    sums = np.asarray(sums.addressable_data(0))
    digest = hashlib.sha256()
    for (path, leaf), (a, b) in zip(leaves, sums.reshape(-1, 2), strict=True):
        digest.update(f"{jax.tree_util.keystr(path)} {leaf.shape} {leaf.dtype} {a} {b};".encode())
    return digest.hexdigest()


def _leaf_sums(leaves: list[jax.Array]) -> jax.Array:
    import jax.numpy as jnp

    def sums(x: jax.Array) -> jax.Array:
        width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}.get(x.dtype.itemsize)
        if width is None:  # 64-bit values (never parameters here): their float32 rounding
            x, width = x.astype(jnp.float32), jnp.uint32
        bits = jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)
        position = jnp.zeros(x.shape, jnp.uint32)  # the flat index, without reshaping (which would gather)
        for axis, stride in enumerate(np.cumprod((1, *x.shape[::-1]))[-2::-1][: x.ndim]):
            position = position + jax.lax.broadcasted_iota(jnp.uint32, x.shape, axis) * jnp.uint32(stride % 2**32)
        first = (bits * (position * jnp.uint32(0x9E3779B1) | jnp.uint32(1))).sum(dtype=jnp.uint32)
        mixed = (bits + position) * jnp.uint32(0x85EBCA6B)
        second = (mixed ^ (mixed >> 13)).sum(dtype=jnp.uint32)
        return jnp.stack([first, second])

    return jnp.stack([sums(leaf) for leaf in leaves])


def dataset_identity(ds: TokenDataset, sample: int = 16, chunk: int = 4096) -> dict[str, Any]:
    """A split as values computed from it depend on it: its size, a digest of its index and of a sample of
    its rows (what files before `content` recorded), and `content`, a digest of every row, so that a folder
    prepared again from other records differs wherever they differ. Reading every row costs a small share
    of the pass over them that the values are. Where it is only names it."""
    digest = hashlib.sha256((ds.folder / "index.json").read_bytes())
    batch = ds[np.unique(np.linspace(0, ds.rows - 1, sample).astype(np.int64))]
    for array in (batch.tokens, batch.weights, batch.segments):
        digest.update(np.ascontiguousarray(array).tobytes())
    content = hashlib.sha256()
    for start in range(0, ds.rows, chunk):
        batch = ds[np.arange(start, min(start + chunk, ds.rows))]
        for array in (batch.tokens, batch.weights, batch.segments):
            content.update(np.ascontiguousarray(array).tobytes())
    return {"folder": str(ds.folder.absolute()), "split": ds.split, "rows": ds.rows, "digest": digest.hexdigest(),
            "content": content.hexdigest()}  # fmt: skip


def read_reference_logps(
    out_dir: Path, identity: dict[str, Any], resumed: bool, notice: Callable[[str], None]
) -> dict[str, np.ndarray] | None:
    """The reference log-probs stored in `out_dir` when they are those of `identity`. None where there are
    none, where the file cannot be read, or in a fresh run where an earlier start in the folder left others
    (its model or data changed since): `notice` then says why they are computed again. A resumed run refuses
    others: its steps so far were trained against the ones it started with."""
    path = out_dir / REFERENCE_LOGPS
    if not path.exists():
        return None
    try:
        with path.open("rb") as f, np.load(f) as stored:
            values = {name: stored[name] for name in stored.files}
        recorded = json.loads(str(values.pop("identity")))
        difference = _difference(recorded, identity, ignore_weights=identity["model"]["weights"] is None)
    except Exception as e:  # a file cut short or overwritten: computed again, as a missing one is
        notice(f"{path}: unreadable ({type(e).__name__}: {one_line(e)}); computing the reference log-probs again")
        return None
    if difference is None:
        return values
    if resumed:
        raise ConfigError(
            f"{path}: the run's reference log-probs are of {difference}; a resumed DPO run keeps the reference and "
            "data it started with (restore them, or train in a new out_dir)"
        )
    notice(f"{path}: holds the reference log-probs of {difference}; computing them again")
    return None


def _difference(recorded: dict[str, Any], identity: dict[str, Any], ignore_weights: bool) -> str | None:
    """How stored reference log-probs differ from what the run needs, in words; None where they do not."""
    model, want = recorded["model"], identity["model"]
    if {**model, "weights": None} != {**want, "weights": None}:
        was = model["init_from"] or f"the random model of seed {model['seed']}"
        return f"another starting model ({was})"
    if not ignore_weights and model.get("weights") != want["weights"]:
        changed = model["init_from"] or "the starting model"
        return f"other starting weights: {changed} has changed since they were computed"
    for name, ds in identity["datasets"].items():
        was = recorded["datasets"].get(name)
        if was is None:
            return f"the datasets {sorted(recorded['datasets'])}, not {name} ({ds['folder']})"
        # a dataset moved elsewhere is the same dataset; one recorded before `content` is compared without it
        wanted = {k: v for k, v in ds.items() if k != "folder" and (k != "content" or "content" in was)}
        same = wanted == {k: v for k, v in was.items() if k != "folder"}
        if not same:
            if was["folder"] == ds["folder"] and was["split"] == ds["split"]:
                return f"{ds['folder']} split {ds['split']!r} as it was before it changed"
            return f"{was['folder']} split {was['split']!r}, not {ds['folder']} split {ds['split']!r}"
    return None


def write_reference_logps(out_dir: Path, identity: dict[str, Any], values: dict[str, np.ndarray]) -> Path:
    """Store reference log-probs with their identity, whole or not at all (a kill midway leaves none)."""
    path, tmp = out_dir / REFERENCE_LOGPS, out_dir / (REFERENCE_LOGPS + ".tmp")
    with tmp.open("wb") as f:
        np.savez(f, identity=np.array(json.dumps(identity)), **values)
    tmp.replace(path)
    return path
