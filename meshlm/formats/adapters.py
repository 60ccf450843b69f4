"""LoRA adapters on disk: PEFT adapter folders both ways, meshlm LoRA runs, and merging into the base.

A PEFT folder holds `adapter_config.json` and `adapter_model.safetensors`, whose tensors are named
`base_model.model.<module>.lora_A.weight` ([rank, in], torch's layout) and `...lora_B.weight` ([out,
rank]) for each adapted `transformers` module. Where the modules are is the architecture's own HF
tensor table (`hf.Arch.tensors`), the one the checkpoint reader uses, so every architecture meshlm
reads has adapters too. A fused q/k/v module (GPT-NeoX's `query_key_value`, CodeGen's `qkv_proj`) has
one A for its three parts: read, each part gets that A and its own rows of B; written, the parts' As
are stacked and B is block-diagonal (rank = parts x rank, alpha scaled to keep alpha / rank), both exact.

In memory an adapter is meshlm's: per projection role, A [layers, in..., rank], B [layers, rank,
out...] and the scale alpha / rank per layer (see `lora.adapter_table`). Layers an adapter skips get
zeros; ranks that differ between layers are padded with zeros (which change nothing).
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path
from typing import Any

import jax
import numpy as np

from meshlm import lora, model
from meshlm.config import PROJECTIONS, CheckpointError, ConfigError, ModelConfig, dtype_of
from meshlm.formats import hf, native
from meshlm.formats.slices import SliceSource, normalise
from meshlm.paths import read_json
from meshlm.sharding import from_host, plan, to_host

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
# Keys of adapter_config.json that change what the adapter computes, with the only values meshlm runs.
UNSUPPORTED = {"use_dora": False, "bias": "none", "fan_in_fan_out": False}

Adapter = dict[str, dict[str, np.ndarray]]  # role -> {"a", "b", "scale"}, on the host


# ---------------------------------------------------------------------------------------------------
# Where each projection's module is


def _modules(arch: hf.Arch, cfg: ModelConfig) -> dict[str, tuple[str, hf.Layout]]:
    """role -> (module name template with {} for the layer, the base weight's layout)."""
    table = arch.tensors(cfg)
    out = {}
    for role in PROJECTIONS:
        template, layout = table[model.projection_name(role)]
        out[role] = (template.removesuffix(".weight"), layout)
    return out


def _arch_for(modules: set[str], cfg: ModelConfig, where: Path) -> hf.Arch:
    """The architecture whose module names the adapter's modules are."""
    best, best_missing = None, None
    for arch in (a for a in hf.ARCHS.values() if not a.mismatches(cfg)):  # those that can be this base
        known = {t.format(i) for t, _ in _modules(arch, cfg).values() for i in range(cfg.n_layer)}
        missing = sorted(modules - known)
        if not missing:
            return arch
        if best_missing is None or len(missing) < len(best_missing):
            best, best_missing = arch, missing
    raise CheckpointError(
        f"{where}: adapter module {best_missing[0]!r} is not a projection of this {cfg.n_layer}-layer "
        f"{best.class_name} base; the adapter was made for another model"
    )


# ---------------------------------------------------------------------------------------------------
# PEFT folders -> meshlm


def is_peft(path: str | Path) -> bool:
    return (Path(path) / CONFIG).is_file()


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: a key matches a module name it ends (at a dot)."""
    for key, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return default


def _check_config(conf: Any, where: Path) -> None:
    """adapter_config.json's numbers and patterns, as PEFT's LoraConfig takes them: a one-line CheckpointError
    naming the key for a config that is not an object, a rank that is not a positive integer, an alpha that is
    not a number, or a rank_pattern / alpha_pattern that is not an object of valid regexes to such values."""
    if not isinstance(conf, dict):
        raise CheckpointError(f"{where}: must be a JSON object, got {type(conf).__name__}")

    def rank(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value > 0

    def alpha(value: Any) -> bool:
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)

    for key, ok, what in (("r", rank, "a positive integer"), ("lora_alpha", alpha, "a finite number")):
        if key in conf and not ok(conf[key]):
            raise CheckpointError(f"{where}: {key} is {conf[key]!r}; it must be {what}")
    for key, ok, what in (("rank_pattern", rank, "positive integer ranks"), ("alpha_pattern", alpha, "numbers")):
        patterns = conf.get(key)
        if patterns is None:
            continue
        if not isinstance(patterns, dict):
            raise CheckpointError(f"{where}: {key} is {type(patterns).__name__}; it must map module patterns to {what}")
        for pattern, value in patterns.items():
            try:
                re.compile(pattern)
            except re.error as e:
                raise CheckpointError(f"{where}: {key} key {pattern!r} is not a valid regex ({e})") from None
            if not ok(value):
                raise CheckpointError(f"{where}: {key}[{pattern!r}] is {value!r}; it must map to {what}")


def read_peft(folder: str | Path, cfg: ModelConfig) -> Adapter:
    """A PEFT LoRA adapter folder as meshlm's adapter for base `cfg`; a one-line error for an adapter
    that is not LoRA, computes something meshlm does not, or does not fit the base."""
    folder = Path(folder)
    conf = read_json(folder / CONFIG, f"{folder}: not a PEFT adapter folder (no {CONFIG})")
    _check_config(conf, folder / CONFIG)
    if conf.get("peft_type") != "LORA":
        raise CheckpointError(f"{folder / CONFIG}: peft_type {conf.get('peft_type')!r}; meshlm runs LORA adapters")
    for key, value in UNSUPPORTED.items():
        if conf.get(key, value) != value:
            raise CheckpointError(
                f"{folder / CONFIG}: {key} is {conf[key]!r}; meshlm runs LoRA adapters with {value!r}"
            )
    if conf.get("modules_to_save"):
        raise CheckpointError(
            f"{folder / CONFIG}: modules_to_save {conf['modules_to_save']} (fully trained modules) is not supported"
        )
    if not (folder / WEIGHTS).is_file():
        raise CheckpointError(f"{folder}: no {WEIGHTS} (save the adapter with safe_serialization=True)")
    from safetensors.numpy import load_file

    tensors = load_file(str(folder / WEIGHTS))
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for name, array in tensors.items():
        m = re.fullmatch(rf"{re.escape(PREFIX)}(.+)\.lora_([AB])\.weight", name)
        if not m:
            raise CheckpointError(f"{folder / WEIGHTS}: tensor {name!r} is not a LoRA A or B weight")
        pairs.setdefault(m.group(1), {})[m.group(2)] = array.astype(np.float32)
    if not pairs:
        raise CheckpointError(f"{folder / WEIGHTS}: holds no LoRA weights")
    if half := [m for m, p in pairs.items() if len(p) != 2]:
        raise CheckpointError(f"{folder / WEIGHTS}: module {half[0]!r} has only one of lora_A and lora_B")

    arch = _arch_for(set(pairs), cfg, folder)
    modules = _modules(arch, cfg)
    r_default, alpha_default = conf.get("r", 8), conf.get("lora_alpha", 8)
    rslora = bool(conf.get("use_rslora", False))
    found: dict[str, dict[int, tuple[np.ndarray, np.ndarray, float]]] = {}  # role -> layer -> (a, b, scale)
    projections = model.projections(cfg)
    for role, (template, layout) in modules.items():
        ins, outs = projections[role].ins, projections[role].outs
        for layer in range(cfg.n_layer):
            module = template.format(layer)
            if module not in pairs:
                continue
            A, B = pairs[module]["A"], pairs[module]["B"]
            rank = A.shape[0]
            parts = 3 if isinstance(layout, hf.Fused) else 1
            if A.shape != (rank, math.prod(ins)) or B.shape != (parts * math.prod(outs), rank):
                raise CheckpointError(
                    f"{folder}: adapter does not match the base: {module} has lora_A {list(A.shape)} and lora_B "
                    f"{list(B.shape)}; the base's {role} maps {math.prod(ins)} inputs to {parts * math.prod(outs)}"
                )
            r = _pattern_value(conf.get("rank_pattern") or {}, module, r_default)
            alpha = _pattern_value(conf.get("alpha_pattern") or {}, module, alpha_default)
            scale = alpha / (math.sqrt(r) if rslora else r)
            a = A.T.reshape(*ins, rank)
            if isinstance(layout, hf.Fused):
                b = layout.read(lambda index, B=B: B[index], tuple(slice(0, n) for n in (rank, *outs)), (rank, *outs))
            else:
                b = B.T.reshape(rank, *outs)
            found.setdefault(role, {})[layer] = (a, b, scale)
    return {role: _stack(layers, cfg, role) for role, layers in found.items()}


def _stack(layers: dict[int, tuple[np.ndarray, np.ndarray, float]], cfg: ModelConfig, role: str) -> dict[str, Any]:
    """One role's per-layer (a, b, scale) as stacked arrays: zeros for missing layers, ranks padded to the largest."""
    projection = model.projections(cfg)[role]
    ins, outs = projection.ins, projection.outs
    rank = max(a.shape[-1] for a, _, _ in layers.values())
    a = np.zeros((cfg.n_layer, *ins, rank), np.float32)
    b = np.zeros((cfg.n_layer, rank, *outs), np.float32)
    scale = np.zeros((cfg.n_layer,), np.float32)
    for layer, (la, lb, ls) in layers.items():
        a[layer, ..., : la.shape[-1]] = la
        b[layer, : lb.shape[0]] = lb
        scale[layer] = ls
    return {"a": a, "b": b, "scale": scale}


# ---------------------------------------------------------------------------------------------------
# meshlm LoRA runs


def is_lora_run(path: str | Path) -> bool:
    """A meshlm training run (or one of its steps) whose checkpoints hold a LoRA adapter."""
    path = native.resolve(path)
    return native.detect(path) and "lora" in native.read_description(path)


def read_run(path: str | Path) -> tuple[dict[str, Any], Adapter]:
    """A LoRA run's (latest, or the given step's) description and adapter, on the host."""
    path = Path(native.resolve(path))
    desc = native.read_description(path)
    adapter = native.restore_tree(path / "params")
    return desc, jax.tree.map(lambda x: np.asarray(x, np.float32), adapter)


def run_base(desc: dict[str, Any]) -> dict[str, Any]:
    """What a LoRA run's frozen base was built from (see `run_start.base_reference`): `init_from` (an absolute
    path, or None for the random model of `seed`), `seed_config` and `dtype` (how it was stored)."""
    return desc["base"]


# ---------------------------------------------------------------------------------------------------
# Adapters onto a mesh


def read(path: str | Path, cfg: ModelConfig) -> Adapter:
    """An adapter for base `cfg` from a PEFT folder or a meshlm LoRA run, on the host."""
    if is_peft(path):
        return read_peft(path, cfg)
    if Path(path).exists() and is_lora_run(path):
        desc, adapter = read_run(path)
        if (theirs := ModelConfig.from_dict(desc["model"])) != cfg:
            diff = [k for k, v in cfg.to_dict().items() if theirs.to_dict()[k] != v]
            raise CheckpointError(f"{path}: adapter does not match the base: its model differs in {diff}")
        return adapter
    raise CheckpointError(f"{path}: not an adapter (expected a PEFT folder with {CONFIG}, or a meshlm LoRA run)")


def load(path: str | Path, cfg: ModelConfig, mesh: jax.sharding.Mesh, dtype: str = "float32") -> model.Params:
    """An adapter placed on `mesh`, sharded like its base (see `lora.adapter_params`)."""
    adapter = read(path, cfg)
    axes = lora.placed_axes(model.projections(cfg), adapter)
    arrays = jax.tree.map(lambda x: x.astype(dtype_of(dtype)) if x.ndim > 1 else x, adapter)
    shardings = plan(arrays, axes, mesh)
    return from_host(arrays, shardings)


# ---------------------------------------------------------------------------------------------------
# meshlm -> PEFT folders


def write_peft(
    folder: str | Path,
    adapter: Adapter,
    cfg: ModelConfig,
    arch: hf.Arch,
    dropout: float = 0.0,
    base: str | None = None,
) -> None:
    """Write `adapter` as a PEFT folder for `arch`'s transformers model (`folder` must be new or empty)."""
    from safetensors.numpy import save_file

    native.check_new_folder(folder)
    modules = _modules(arch, cfg)
    tensors: dict[str, np.ndarray] = {}
    ranks: dict[str, tuple[int, float]] = {}  # module -> (rank, alpha)
    fused = {role for role in adapter if isinstance(modules[role][1], hf.Fused)}
    for layer in range(cfg.n_layer):
        for role, parts in adapter.items():
            if role in fused:
                continue
            name = modules[role][0].format(layer)
            rank = parts["a"].shape[-1]
            tensors[f"{PREFIX}{name}.lora_A.weight"] = parts["a"][layer].reshape(-1, rank).T
            tensors[f"{PREFIX}{name}.lora_B.weight"] = parts["b"][layer].reshape(rank, -1).T
            ranks[name] = (rank, float(parts["scale"][layer]) * rank)
        if fused:
            name, A, B, rank, scale = _fuse(adapter, sorted(fused, key=PROJECTIONS.index), modules, layer)
            tensors[f"{PREFIX}{name}.lora_A.weight"], tensors[f"{PREFIX}{name}.lora_B.weight"] = A, B
            ranks[name] = (rank, scale * rank)
    (rank, alpha), _ = Counter(ranks.values()).most_common(1)[0]
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted({name.rsplit(".", 1)[-1] for name in ranks}),
        "rank_pattern": {name: r for name, (r, _) in ranks.items() if r != rank},
        "alpha_pattern": {name: a for name, (_, a) in ranks.items() if a != alpha},
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    # safetensors writes an array's buffer as is: a Fortran-ordered one would be read back transposed
    save_file(
        {k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(folder / WEIGHTS), metadata={"format": "pt"}
    )
    (folder / CONFIG).write_text(json.dumps(config, indent=2))


def _fuse(
    adapter: Adapter, roles: list[str], modules: dict[str, tuple[str, hf.Layout]], layer: int
) -> tuple[str, np.ndarray, np.ndarray, int, float]:
    """One layer's q/k/v adapters as one adapter of the fused module: the As stacked, B block-diagonal
    (zeros for an untargeted part). Returns (module, A, B, rank, scale)."""
    scales = {float(adapter[role]["scale"][layer]) for role in roles}
    if len(scales) > 1:
        raise ConfigError(f"adapters of {roles} have different scales {sorted(scales)}; one fused module has one")
    layout = modules[roles[0]][1]
    ranks = [adapter[role]["a"].shape[-1] for role in roles]
    total = sum(ranks)
    A = np.concatenate([adapter[role]["a"][layer].reshape(-1, r).T for role, r in zip(roles, ranks, strict=True)])
    out_shape = adapter[roles[0]]["b"].shape[2:]
    parts, start = {}, 0
    for part in "qkv":
        b = np.zeros((total, *out_shape), np.float32)
        if part in roles:
            r = adapter[part]["a"].shape[-1]
            b[start : start + r] = adapter[part]["b"][layer]
            start += r
        parts[part] = modules[part][1].to_hf(b)
    return modules[roles[0]][0].format(layer), A, layout.join(parts), total, scales.pop()


def export_run(run: str | Path, folder: str | Path, overwrite: bool = False) -> Path:
    """Write a meshlm LoRA run's adapter (its latest step, or the step given) as a PEFT folder for the
    base's transformers class: the base folder's own architecture when it is a Hugging Face folder (so a
    CodeGen base gets CodeGen's module names), else the one `hf.export_arch` picks. Returns the step read.
    `folder` is written as `meshlm.convert` writes its destination (`overwrite` likewise)."""
    run = Path(native.resolve(run))
    if not (Path(run).exists() and is_lora_run(run)):
        raise CheckpointError(f"{run}: not a meshlm LoRA run (its checkpoints hold no adapter)")
    desc, adapter = read_run(run)
    cfg = ModelConfig.from_dict(desc["model"])
    base = run_base(desc)["init_from"]
    arch = hf.export_arch(cfg)
    if base is not None and hf.detect(base):
        arch = hf.ARCHS.get(read_json(Path(base) / "config.json", "").get("model_type"), arch)
    with native.staged(folder, "export-adapter", overwrite) as staging:
        write_peft(staging, adapter, cfg, arch, dropout=desc["lora"].get("dropout", 0.0), base=base)
    return run


# ---------------------------------------------------------------------------------------------------
# Merging


def merged_source(cfg: ModelConfig, source: SliceSource, adapter: Adapter) -> SliceSource:
    """`source` with W + scale · A B (`lora.delta`) in place of each adapted projection, slice by slice:
    merging streams through any writer in the memory a slice takes."""
    names = {model.projection_name(role): role for role in adapter}
    projections = model.projections(cfg)

    def merged(name: str, shape: tuple[int, ...]) -> Any:
        read = source(name, shape)
        if name not in names:
            return read
        parts, n_in = adapter[names[name]], projections[names[name]].n_in

        def read_merged(index: tuple[slice, ...]) -> np.ndarray:
            index = normalise(index, shape)
            layers, ins, outs = index[0], index[1 : 1 + n_in], index[1 + n_in :]
            a = parts["a"][(layers, *ins)]  # [l, in..., r]
            b = parts["b"][(layers, slice(None), *outs)]  # [l, r, out...]
            delta = np.stack([lora.delta(*layer) for layer in zip(a, b, parts["scale"][layers], strict=True)])
            base = read(index)
            return (base.astype(np.float32) + delta).astype(base.dtype)

        return read_merged

    return merged


def host_adapter(params: model.Params) -> Adapter:
    """A placed adapter (`params["lora"]`) back on the host."""
    return jax.tree.map(lambda x: np.asarray(to_host(x), np.float32), params)
