"""`meshlm.load` and the loaded model: the one front door for the CLI, the server and the evaluator."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from meshlm import model, quant
from meshlm.config import QUANTIZED, ConfigError, InputError, MeshlmError, ModelConfig, dtype_of
from meshlm.formats import adapters as adapter_files
from meshlm.formats import native, registry
from meshlm.formats.slices import Placed, place, projection_streams, stack_stream
from meshlm.param import Param, init_layer, init_leaf, is_param, is_stacked, leaf_keys
from meshlm.serve.adapter_slots import Adapter
from meshlm.serve.config import EngineConfig
from meshlm.serve.engine import Draft, Engine
from meshlm.serve.grammar import Constraint
from meshlm.serve.outputs import Completion
from meshlm.serve.params import SAMPLING_FIELDS, SamplingParams
from meshlm.sharding import SERVING, Rules, batch_ways, describe, from_host, make_mesh, named_sharding, plan, to_host
from meshlm.tokenizer import Tokenizer, TokenizerSpec, load_tokenizer, special_token_id, tokenizer_files

STREAM_BYTES = 1 << 30  # from_config makes a float stack larger than this (in float32) layer by layer
SEQ_BUCKET = 64  # logits() pads sequence lengths up to a multiple of this, so few shapes compile
GENERATE_BATCH = 32  # rows `generate` decodes at once; more prompts wait for free rows
COMPILED_FUNCTIONS = 16  # jitted forward and scoring closures kept: two per (config, policy) a process uses


def _target_logprobs(
    params: model.Params,
    tokens: jax.Array,
    cfg: ModelConfig,
    policy: model.Policy,
    targets: jax.Array,
    at: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """log p(targets) and the argmax token, with the LM head run only at the positions `at` [B, K]: for
    scoring a short continuation after a long context this skips most of the head's vocab-sized matmul."""
    x = model.hidden_states(params, tokens, cfg, policy)
    logits = model.unembed(params, jnp.take_along_axis(x, at[..., None], axis=1), cfg)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    target_logprobs = jnp.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0]
    # Padded vocabulary rows (>= n_vocab_used) are never predicted, so the argmax skips them.
    return target_logprobs, jnp.argmax(logits[..., : cfg.n_vocab_used], axis=-1).astype(jnp.int32)


@functools.lru_cache(maxsize=COMPILED_FUNCTIONS)
def _compiled(cfg: ModelConfig, policy: model.Policy, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn(params, tokens, cfg, policy, *args)` jitted, one per (config, policy, fn) and shared by every
    model loaded with them: jit then compiles once per input shape and sharding, not once per model. The
    module owns these for the life of the process, the most recently used COMPILED_FUNCTIONS of them: a
    process that loads model after model drops the oldest closures, and their executables with them."""
    return jax.jit(lambda params, tokens, *args: fn(params, tokens, cfg, policy, *args))


class LanguageModel:
    """A GPT-J-family model placed on a mesh, with the parameters it was loaded with.

    `folder` is the checkpoint it came from: its tokenizer.json (if any) is the model's tokenizer unless
    `tokenizer` names another, and travels with the weights when the model is saved."""

    def __init__(
        self,
        config: ModelConfig,
        params: model.Params,
        mesh: Mesh,
        dtype: str = "float32",
        tokenizer: TokenizerSpec = None,
        folder: str | Path | None = None,
        quantized: str | None = None,
    ):
        self.config = config
        self.params = params
        self.quantized = quantized  # "int8", "w8a8" or "nf4" when the projections are stored quantized
        self.mesh = mesh
        self.dtype = dtype
        self.policy = model.Policy(param_dtype=dtype, compute_dtype=dtype)
        self.folder = folder
        self._tokenizer = tokenizer
        self.adapters: dict[str, str | Path] = {}  # name -> folder: what `generate(adapter=name)` may run

    def __repr__(self) -> str:
        c = self.config
        return (
            f"LanguageModel({c.n_layer} layers, d_model {c.d_model}, {model.count_params(c):,} params, "
            f"{self.dtype}, {describe(self.mesh)})"
        )

    def _check_tokens(self, tokens: np.ndarray, name: str = "tokens") -> np.ndarray:
        tokens = np.asarray(tokens)
        if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
            raise InputError(f"{name} must be an integer array [batch, seq], got {tokens.dtype} {tokens.shape}")
        T, context = tokens.shape[1], self.config.max_seq_len
        if T > context:
            raise InputError(f"sequence length {T} exceeds the model's context ({context})")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.config.vocab_size):
            raise InputError(f"{name}: token ids must lie in [0, {self.config.vocab_size})")
        return tokens

    def _padded(self, tokens: np.ndarray, pad_seq: bool = True) -> jax.Array:
        """Right-pad to a batch the mesh divides and (with `pad_seq`) a length that is a multiple of
        SEQ_BUCKET, so few shapes compile; causal attention makes right padding harmless."""
        B, T = tokens.shape
        ways = batch_ways(self.mesh)
        padded_b = -(-B // ways) * ways
        padded_t = min(-(-T // SEQ_BUCKET) * SEQ_BUCKET, self.config.max_seq_len) if pad_seq else T
        padded = np.zeros((padded_b, padded_t), np.int32)
        padded[:B, :T] = tokens
        return from_host(padded, named_sharding(self.mesh, ("batch", "seq")))

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        """Float32 logits [B, T, vocab_size] for int tokens [B, T] (no padding inside rows)."""
        tokens = self._check_tokens(tokens)
        B, T = tokens.shape
        with jax.set_mesh(self.mesh):
            out = _compiled(self.config, self.policy, model.forward)(self.params, self._padded(tokens))
        return to_host(out)[:B, :T]

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        """The one given to `load`, else the model folder's tokenizer.json, else GPT-2 BPE; read on first use."""
        return load_tokenizer(self._tokenizer, self.folder)

    def engine(
        self,
        config: EngineConfig | None = None,
        *,
        draft: LanguageModel | None = None,
        adapters: Mapping[str, str | Path] | None = None,
        tokenizer: Tokenizer | None = None,
        rules: Rules = SERVING,
        **settings: Any,
    ) -> Engine:
        """A generation engine of its own for this model, as `config` (an `EngineConfig`) says, with `settings`
        (`max_batch=`, `max_len=`, `kv_tokens=`, `page_size=`, `prefix_caching=`, `ngram=`, `speculate=`,
        `max_adapters=`, `max_lora_rank=`, `chunk=`, `max_queue=`, `prefill_tokens=`, `mixed_steps=`, `kv_cache_dtype=`,
        `attention=`: its fields) changed in it; the server runs one.

        `draft`: a smaller model with this one's tokenizer, loaded on the same mesh, that proposes
        `speculate` tokens per step for speculative decoding. `attention`: the model's attention
        implementation for this engine ("xla" turns the GPU paged-attention kernel off; see `Policy`).
        `kv_cache_dtype`: "int8" stores the KV cache in half a bfloat16 pool's bytes (vLLM's option name;
        None: the compute dtype).
        `adapters` (name -> a PEFT folder or a meshlm LoRA run) are read here: the engine itself reads no
        files. Add one later by its weights: `engine.add_adapter(name, lm.read_adapter(name, path))`."""
        config = (config or EngineConfig()).replace(**settings)
        weights = {name: read_adapter(name, path, self.config) for name, path in (adapters or {}).items()}
        if draft is not None and draft.mesh != self.mesh:
            raise InputError(f"the draft model is on mesh {describe(draft.mesh)}, not {describe(self.mesh)}")
        return Engine(
            self.params, self.config, self.policy, self.mesh, config, tokenizer=tokenizer, adapters=weights or None,
            draft=None if draft is None else Draft(draft.params, draft.config, draft.policy), rules=rules,
        )  # fmt: skip

    @functools.cached_property
    def _engine(self) -> Engine:
        """The engine `generate`, `generate_tokens` and `stream` share (its KV pool is allocated on first use),
        with a slot per added adapter."""
        return self.engine(max_batch=GENERATE_BATCH, **({"adapters": self.adapters} if self.adapters else {}))

    def read_adapter(self, name: str, path: str | Path) -> Adapter:
        """The LoRA adapter in folder `path` (a PEFT folder or a meshlm LoRA run) as an engine of this model
        takes it (`Engine.add_adapter`); ConfigError when it does not fit this model."""
        return read_adapter(name, path, self.config)

    def add_adapter(self, name: str, path: str | Path) -> None:
        """Add a LoRA adapter (a PEFT folder or a meshlm LoRA run) that `generate(..., adapter=name)` runs on
        this model: prompts of any mix of adapters (and the base) decode together in one batch. An engine of
        your own takes them as `engine(adapters={name: path, ...})`."""
        if "_engine" in self.__dict__ and self._engine.adapters is not None:
            self._engine.check_adapter_name(name)  # before reading the files
            self._engine.add_adapter(name, self.read_adapter(name, path))
        else:  # the shared engine, when it is made, has a slot for each
            self.__dict__.pop("_engine", None)
            if not Path(path).exists():
                raise InputError(f"adapter {name!r}: {path} does not exist")
        self.adapters[name] = path

    def encode_prompt(self, text: str) -> list[int]:
        """Tokens of a prompt; an empty prompt starts from <|endoftext|>, as GPT-2 models were trained."""
        return self.tokenizer.encode(text) or [self.tokenizer.eot_id]

    def sampling(
        self,
        max_new_tokens: int = 32,
        *,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
        **settings: Any,
    ) -> SamplingParams:
        """Sampling settings: `SamplingParams`' fields by name (its docstring says what each means). The one
        builder of `SamplingParams` from a user's settings: `generate`, `stream`, `meshlm sample`, the server's
        requests and the lm-eval model all use it. Here `stop` may be one string, and `stop_token_ids` add to the
        model's EOS ids, which `ignore_eos` drops (`end_ids`, vLLM's rule; `ignore_eos=True` alone runs to
        max_new_tokens)."""
        if unknown := ", ".join(map(repr, sorted(settings.keys() - SAMPLING_FIELDS))):
            raise InputError(f"unknown sampling setting {unknown}: the settings are SamplingParams' fields")
        stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
        ids = self.end_ids(stop_token_ids or (), ignore_eos)
        return SamplingParams(max_new_tokens=max_new_tokens, stop=stop, stop_token_ids=ids, **settings)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """The tokens that end a chat reply or a served row: <|endoftext|>, and the tokenizer's EOS token when
        that is another (a chat model's end of turn, say); those the model can produce (a tiny test model's
        vocabulary may stop short of the tokenizer's end of text)."""
        tok = self.tokenizer
        eos = special_token_id(tok, "eos_token")
        ids = (tok.eot_id,) if eos in (None, tok.eot_id) else (tok.eot_id, eos)
        return tuple(i for i in ids if i < self.config.n_vocab_used)

    def end_ids(self, stop_token_ids: Sequence[int] = (), ignore_eos: bool = False) -> tuple[int, ...]:
        """The tokens that end a row, vLLM's one rule: the EOS ids (`eos_ids`) unless `ignore_eos`, and
        `stop_token_ids` besides."""
        return tuple(dict.fromkeys([*(() if ignore_eos else self.eos_ids), *stop_token_ids]))

    def generate(
        self,
        prompts: str | Sequence[str],
        max_new_tokens: int = 32,
        *,
        seed: int | None = None,
        adapter: str | None = None,
        json_schema: dict[str, Any] | bool | None = None,
        regex: str | None = None,
        choice: Sequence[str] | None = None,
        **settings: Any,
    ) -> list[str]:
        """Continuations of text prompts, decoded together as one batch (with the LoRA adapter added as
        `adapter`, see `add_adapter`). `settings` are `sampling`'s: `SamplingParams`' fields by name, whose
        docstring says what each means.

        temperature 0 is greedy decoding; otherwise the logits are divided by `temperature`, cut to the
        `top_k` most likely tokens (0: all), then to the smallest set reaching probability `top_p`, then
        to the tokens at least `min_p` times as likely as the likeliest. Before that `logit_bias` (token id
        -> bias in [-100, 100]) is added to the logits, and the repetition, frequency and presence
        penalties lower those of tokens already seen.
        Generation ends at `max_new_tokens`, at a stop token (`eos_ids` by default, none with
        `ignore_eos`) or before the first `stop` string (after it with `include_stop_str_in_output`), but
        not before `min_tokens` tokens. With `seed`, prompt i samples with seed + i, reproducibly.
        The output can be constrained to JSON valid against `json_schema` ({} or True: any JSON), to a
        `regex` or to one `choice` (one of the three, or a `constraint`); tokens that would leave it are
        never chosen.
        """
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not all(isinstance(p, str) for p in prompts):
            raise InputError("prompts must be strings")
        given = [c for c in (settings.pop("constraint", None),
                             json_schema is not None and Constraint.json_schema(json_schema, "json_schema"),
                             regex is not None and Constraint.regex(regex, "regex"),
                             choice is not None and Constraint.choice(list(choice), "choice")) if c]  # fmt: skip
        if len(given) > 1:
            raise InputError("constrain the output to one of json_schema, regex and choice, or a constraint")
        base = self.sampling(max_new_tokens, constraint=given[0] if given else None, **settings)
        params = [base.replace(seed=None if seed is None else seed + i) for i in range(len(prompts))]
        prompts = [self.encode_prompt(p) for p in prompts]
        results = self.generate_tokens(prompts, params, adapters=None if adapter is None else [adapter] * len(prompts))
        return [r.text or "" for r in results]

    def generate_tokens(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        chunk: int = 64,
        adapters: Sequence[str | None] | None = None,
    ) -> list[Completion]:
        """Token-level generation: one Completion (tokens, log-probabilities, finish reason, text) per prompt;
        prompt i runs the added adapter named `adapters[i]` (None: the model alone)."""
        prompts, params = self._check_prompts(prompts, params)
        if adapters is not None and (unknown := sorted({a for a in adapters if a is not None} - set(self.adapters))):
            raise InputError(f"no adapter named {unknown[0]!r} was added (see add_adapter)")
        return self._engine.generate(prompts, params, self._text_tokenizer(params), chunk, adapters)

    def stream(self, prompt: str, chunk: int = 4, **settings) -> Iterator[str]:
        """One prompt's continuation, piece by piece as it is generated (settings as in `sampling`).
        A device call per `chunk` tokens: small chunks stream smoothly, large ones decode faster."""
        params = self.sampling(**settings)
        for (seq,) in self._engine.run([self.encode_prompt(prompt)], [params], self.tokenizer, chunk):
            if piece := seq.take_text():
                yield piece

    def _check_prompts(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> tuple[list[list[int]], list[SamplingParams]]:
        prompts = [[int(t) for t in p] for p in prompts]  # their ids are checked by the engine, as a server's are
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise InputError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        return prompts, params

    def _text_tokenizer(self, params: Sequence[SamplingParams]) -> Tokenizer | None:
        """The tokenizer for text output; without stop strings, token-level generation works without one."""
        try:
            return self.tokenizer
        except ConfigError:
            if any(p.stop for p in params):
                raise
            return None

    def token_logprobs(
        self, tokens: np.ndarray, targets: np.ndarray, at: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """log p(targets[b, j] | tokens[b, : at[b, j] + 1]) as float32 [B, K], and the most likely token
        there (int32 [B, K], among the tokenizer's n_vocab_used ids). `at` [B, K] picks the positions to
        score (default: every position, K = T).

        The LM head, log-softmax and gather run on the devices at those positions only, so only [B, K]
        numbers come back; this is what scoring (evaluation, perplexity) needs. Each distinct K compiles.
        """
        tokens = self._check_tokens(tokens)
        B, T = tokens.shape
        if at is None:
            at = np.broadcast_to(np.arange(T), (B, T))
        at, targets = np.asarray(at), self._check_tokens(targets, "targets")
        if at.shape != targets.shape or at.shape[0] != B:
            raise InputError(f"targets {targets.shape} and positions {at.shape} must both be [{B}, K]")
        if at.size and (at.min() < 0 or at.max() >= T):
            raise InputError(f"positions must lie in [0, {T})")
        with jax.set_mesh(self.mesh):
            score = _compiled(self.config, self.policy, _target_logprobs)
            at_, targets_ = (self._padded(a, pad_seq=False) for a in (at, targets))
            logprobs, argmax = score(self.params, self._padded(tokens), targets_, at_)
        return to_host(logprobs)[:B], to_host(argmax)[:B]

    def save(self, path: str | Path, format: str = "meshlm", dtype: str | None = None) -> None:
        """Write the weights as a meshlm checkpoint or a Hugging Face folder (the architecture's
        `transformers` class), with the model's tokenizer files; `path` must be new or empty."""
        write = registry.writer(format, "save format")
        if self.quantized or "lora" in self.params:
            what = f"{self.quantized}-quantized weights" if self.quantized else "an unmerged LoRA adapter"
            raise ConfigError(
                f"this model holds {what}; save the full-precision model, or write a merged one with `meshlm merge`"
            )
        files = tokenizer_files(self._tokenizer, self.folder)
        write(path, self.config, dtype or self.dtype, Placed(self.params), files)


def load(
    path: str | Path,
    mesh: str | Mesh | None = None,
    dtype: str = "float32",
    *,
    seed_config: str | Path | None = None,
    tokenizer: TokenizerSpec = None,
    quantize: str | None = None,
    adapter: str | Path | None = None,
    adapters: Mapping[str, str | Path] | None = None,
) -> LanguageModel:
    """Load a meshlm checkpoint, a Hugging Face folder or a seed step_N folder onto `mesh`.

    A training run's folder (or a step folder inside it) loads its latest (or that) step's parameters.

    `mesh` is a spec such as "data=1,fsdp=2,model=4", a `jax.sharding.Mesh`, or None for one device.
    `seed_config` (seed checkpoints only) is the seed's run JSON, for the head count and rotary
    dimensions that its weights do not record; GPT-J-6B's values are the default.
    `tokenizer` (for text) is a tokenizer.json or .tiktoken file, or a model folder; by default the
    checkpoint's own tokenizer.json (Pythia's GPT-NeoX BPE, for one), else GPT-2 BPE. It is read on
    first use (`lm.tokenizer`), so models used token by token need none.
    `quantize` ("int8", "w8a8" or "nf4") stores the six projections' weights quantized (`meshlm.quant`), the
    rest in `dtype`. `adapter` is a LoRA adapter to run with the model unmerged: a PEFT adapter folder
    or a meshlm LoRA run (or one of its steps). A LoRA run given as `path` loads its base (quantized as it
    was trained, unless `quantize` says otherwise) with its adapter. `adapters` (name -> folder) are LoRA
    adapters that `generate(..., adapter=name)` runs per prompt, over one base (see `add_adapter`).
    """
    if adapters:
        lm = load(path, mesh, dtype, seed_config=seed_config, tokenizer=tokenizer, quantize=quantize, adapter=adapter)
        for name, folder in adapters.items():
            lm.add_adapter(name, folder)
        return lm
    dtype_of(dtype)
    path, fmt = registry.resolve(path)
    if fmt == "meshlm" and adapter_files.is_lora_run(path):  # a LoRA run: its base, with its adapter
        if adapter is not None:
            raise ConfigError(f"{path} is a LoRA run's adapter, not a base for another adapter")
        desc = native.read_description(path)
        base = adapter_files.run_base(desc)
        quantize = quantize or (base["dtype"] if base["dtype"] in QUANTIZED else None)  # as it was trained
        if base["init_from"] is None:  # the random model of the run's seed
            cfg = ModelConfig.from_dict(desc["model"])
            lm = from_config(cfg, mesh, dtype, base["seed"], tokenizer, quantize)
            params = {**lm.params, "lora": adapter_files.load(path, cfg, lm.mesh, dtype)}
            return LanguageModel(cfg, params, lm.mesh, dtype, tokenizer, folder=path, quantized=quantize)
        seed_config = seed_config or base["seed_config"]
        return load(
            base["init_from"],
            mesh,
            dtype,
            seed_config=seed_config,
            tokenizer=tokenizer,
            quantize=quantize,
            adapter=path,
        )
    device_mesh = make_mesh(mesh)
    if fmt == "meshlm" and seed_config is None and not quantize:  # orbax restores its own arrays onto any mesh
        cfg, params = native.restore_params(path, device_mesh, dtype)
    else:
        cfg, source = registry.open(path, fmt, dtype, seed_config)
        params = place(cfg, source, device_mesh, dtype, quantize)
    if adapter is not None:
        params = {**params, "lora": adapter_files.load(adapter, cfg, device_mesh, dtype)}
    return LanguageModel(cfg, params, device_mesh, dtype, tokenizer, folder=path, quantized=quantize)


def read_adapter(name: str, path: str | Path, cfg: ModelConfig) -> Adapter:
    """The LoRA adapter in folder `path` (a PEFT folder or a meshlm LoRA run), read for a model of `cfg`
    (ConfigError when it does not fit it), as an engine takes it."""
    if not Path(path).exists():
        raise InputError(f"adapter {name!r}: {path} does not exist", param="lora_path")
    return Adapter(adapter_files.read(path, cfg), str(path))


def is_adapter(path: str | Path) -> bool:
    """Whether `path` holds a LoRA adapter (a PEFT folder or a meshlm LoRA run), by its files' names and
    description alone (no weights are read)."""
    try:
        return adapter_files.is_peft(path) or adapter_files.is_lora_run(path)
    except (MeshlmError, OSError, ValueError, KeyError, TypeError):
        return False


def read_config(path: str | Path, seed_config: str | Path | None = None) -> ModelConfig:
    """The model config of anything `load` reads (a LoRA run: its base's), without reading its weights."""
    path, fmt = registry.resolve(path)
    if fmt == "meshlm":
        return ModelConfig.from_dict(native.read_description(path)["model"])
    return registry.open(path, fmt, "float32", seed_config)[0]


def convert(
    src: str | Path,
    dst: str | Path,
    to: str,
    dtype: str = "float32",
    seed_config: str | Path | None = None,
    overwrite: bool = False,
) -> None:
    """Convert a checkpoint in any format meshlm reads to `to` ("meshlm" or "hf"), written in `dtype`.

    Streamed on this host a slice at a time, straight from the source's files to the destination's:
    the model is never loaded, and peak memory stays a small multiple of the largest tensor whatever
    the model size. The source's tokenizer files come along. In a multi-process job only process 0 converts.

    `dst` must be new or empty; with `overwrite` it may hold meshlm's own output (a checkpoint it wrote,
    finished or not), replaced once the new one is whole. The checkpoint is written beside `dst` in
    `DST.convert-unfinished` and renamed to `dst` at the end (`native.staged`).
    """
    _stream(src, dst, to, dtype, seed_config, overwrite=overwrite)


def merge(
    base: str | Path,
    adapter: str | Path,
    dst: str | Path,
    to: str = "meshlm",
    dtype: str = "float32",
    seed_config: str | Path | None = None,
    overwrite: bool = False,
) -> None:
    """Write `base` with a LoRA `adapter` (a PEFT folder or a meshlm LoRA run) merged into its weights,
    W + scale * A B, as a full model in format `to`. Streamed like `convert`, in the same bounded memory,
    and written into `dst` as `convert` writes (`overwrite` likewise)."""
    _stream(base, dst, to, dtype, seed_config, adapter, overwrite)


def export_adapter(run: str | Path, dst: str | Path, overwrite: bool = False) -> Path:
    """Write a meshlm LoRA `run`'s adapter as a PEFT folder `dst` (`overwrite` as in `convert`); returns the step."""
    return adapter_files.export_run(run, dst, overwrite=overwrite)


def _stream(
    src: str | Path,
    dst: str | Path,
    to: str,
    dtype: str,
    seed_config: str | Path | None,
    adapter: str | Path | None = None,
    overwrite: bool = False,
) -> None:
    write = registry.writer(to, "target format")
    dtype_of(dtype)
    native.check_new_folder(dst, overwrite)
    if jax.process_index() != 0:
        return
    src, fmt = registry.resolve(src)
    cfg, source = registry.open(src, fmt, dtype, seed_config)
    if adapter is not None:
        source = adapter_files.merged_source(cfg, source, adapter_files.read(adapter, cfg))
    files = tokenizer_files(model=src)
    size = model.count_params(cfg) * np.dtype(dtype_of(dtype)).itemsize
    with native.staged(dst, "convert" if adapter is None else "merge", overwrite, size) as folder:
        write(folder, cfg, dtype, source, files)


def from_config(
    cfg: ModelConfig,
    mesh: str | Mesh | None = None,
    dtype: str = "float32",
    seed: int = 0,
    tokenizer: TokenizerSpec = None,
    quantize: str | None = None,
) -> LanguageModel:
    """A randomly initialised model, created shard by shard directly on `mesh` (`quantize` as in `load`).
    Each projection (quantized) and each stacked weight over `STREAM_BYTES` in float32 is made one layer at
    a time (`param.init_layer`) into its stack, the rest in one program, so the devices hold the model as
    stored plus one layer in float32: GPT-J-6B in NF4 (or bf16) starts on a 16 GiB chip. Either way the
    values are `model.init`'s."""
    device_mesh = make_mesh(mesh)
    key = jax.random.key(seed)
    table, keys = model.param_table(cfg), leaf_keys(model.param_table(cfg), key)
    abstract = model.abstract_params(cfg, dtype)
    shardings = plan(abstract, model.logical_axes(cfg), device_mesh)
    streams = projection_streams(cfg, quantize, device_mesh, dtype) if quantize else {}
    for path, p in jax.tree_util.tree_flatten_with_path(table, is_leaf=is_param)[0]:
        name = model.param_name(path)
        if name not in streams and is_stacked(p) and p.init in ("normal", "uniform") and 4 * p.size > STREAM_BYTES:
            at = tuple(str(k.key) for k in path)
            streams[name] = stack_stream(None, 0, quant.weight(abstract, at), quant.weight(shardings, at), p.shape[0])
    is_streamed = lambda path, _: model.param_name(path) in streams
    # the rest (embedding, head, norms, biases) in one program: small beside the stacks
    rest = lambda tree: jax.tree_util.tree_map_with_path(
        lambda path, x: None if is_streamed(path, x) else x, tree, is_leaf=is_param
    )
    init_rest = lambda keys: jax.tree.map(lambda p, k: init_leaf(p, k, dtype), rest(table), keys, is_leaf=is_param)
    params = jax.jit(init_rest, out_shardings=rest(shardings))(rest(keys))

    def build(path: tuple[Any, ...], p: Param, k: jax.Array, made: Any) -> Any:
        name = model.param_name(path)
        return streams[name](_layer_maker(p, dtype), lambda i: (k,)) if name in streams else made

    params = jax.tree_util.tree_map_with_path(build, table, keys, params, is_leaf=is_param)
    return LanguageModel(cfg, params, device_mesh, dtype, tokenizer, quantized=quantize)


@functools.cache  # one maker per declaration, so equal projections share one compiled program
def _layer_maker(p: Param, dtype: str) -> Callable[[jax.Array, Any], jax.Array]:
    return lambda key, layer: init_layer(p, key, layer, dtype)
