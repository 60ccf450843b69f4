"""A serving step's attention two ways over the same keys and values, on this machine's first device: meshlm's
(its paged kernel for the decoding rows, `kv_cache.CacheView.attend`; a prompt chunk's pages read by DMA and
attended by XLA, `CacheView.read` and `attention.dense`, as `model.decode_spans` does) and JAX's ragged paged
attention kernel (`jax.experimental.pallas.ops.tpu.ragged_paged_attention`: every row, chunk or decode token, in
one call, its pool laid out as it takes it, [pages, page_size, 2 x heads, head_dim]).

Issue 38 asks for JAX's kernel; meshlm's pool is laid out for its own ([heads, layers, pages, page_size, head_dim],
an int8 pool with a float32 scale per token and head, where JAX's takes one scale per pool). This measures what
the change of layout would buy before it is made. Two steps, each over `--layers` layers in one program:

- decode: `--rows` + 1 rows of one token each, every row holding `--context` tokens;
- mixed: `--rows` rows of one token and a prompt's chunk of `--chunk` tokens after `--done` of its tokens.

Each way's time a layer, the keys' and values' bytes a layer over that time against a large copy's GB/s timed in the
same run (an int8 pool's codes: meshlm's also reads 8 bytes of scales a token and head, 3% more at heads of 128),
and its largest error against float32 attention over the same (dequantized) pages are printed; a way that errs more
than `--tolerance` is reported and fails the run. The JAX version, the device and the load are printed.

    python benchmarks/ragged_kernel.py [--heads 16 --head-dim 256 --page 128 --layers 4 --rows 15 --context 2048
        --chunk 256 --done 768 --kv bfloat16,int8]

Off a TPU meshlm's kernels run in Pallas' TPU interpreter and JAX's kernel, which the interpreter cannot run, is
replaced by its reference (`ref_ragged_paged_attention`): a check of the script and the layout, not a timing
(`--layers 1 --rows 2 --context 256 --chunk 128 --done 128 --heads 2 --head-dim 128 --repeats 1`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu import ragged_paged_attention as jax_ragged

from benchmarks.decode_rows import copy_gbs
from benchmarks.timing import best_times, load_average
from meshlm.attention import Kernel, dense
from meshlm.kv_cache import CacheView, KVCache, dequantize
from meshlm.quant import absmax_int8
from meshlm.sharding import traced_backend

Way = Callable[[jax.Array, "Inputs"], jax.Array]  # (layer, inputs) -> that layer's attention output [N, H, K]


@dataclass(frozen=True)
class Step:
    """One serving step's rows: decode rows of one token at `context` tokens held, and a chunk of `chunk` tokens
    after `done` (none where `chunk` is 0). `tables`: each row's pages, the chunk's row last."""

    rows: int
    context: int
    chunk: int
    done: int
    page: int

    @property
    def decode_pages(self) -> int:
        return math.ceil(self.context / self.page)

    @property
    def chunk_pages(self) -> int:
        return math.ceil((self.done + self.chunk) / self.page) if self.chunk else 0

    @property
    def pages(self) -> int:  # page 0 is never handed to a row
        return 1 + self.rows * self.decode_pages + self.chunk_pages

    @property
    def tokens_read(self) -> int:
        return self.rows * self.context + (self.done + self.chunk if self.chunk else 0)

    def tables(self) -> tuple[np.ndarray, np.ndarray]:
        decode = 1 + np.arange(self.rows * self.decode_pages, dtype=np.int32).reshape(self.rows, self.decode_pages)
        chunk = decode.size + 1 + np.arange(self.chunk_pages, dtype=np.int32)[None]
        return decode, chunk


def pools(key: jax.Array, heads: int, layers: int, step: Step, head_dim: int, kv: str) -> tuple[KVCache, KVCache]:
    """The same keys and values as meshlm keeps them (int8 with a scale per token and head, scales [L, pages, H,
    page_size]; or bfloat16) and as JAX's kernel takes them (int8 with one scale per pool, held as a float32
    scalar; or bfloat16), both [H, L, pages, page_size, K]."""
    shape = (heads, layers, step.pages, step.page, head_dim)
    k, v = (jax.random.normal(part, shape, jnp.bfloat16) for part in jax.random.split(key))
    if kv == "bfloat16":
        return KVCache(k, v), KVCache(k, v)

    def per_token(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        codes, scales = absmax_int8(x)  # scales [H, L, P, page]
        return codes, jnp.transpose(scales, (1, 2, 0, 3))

    def per_pool(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        scale = jnp.max(jnp.abs(x)) / 127
        return jnp.clip(jnp.rint(x / scale), -127, 127).astype(jnp.int8), scale

    (qk, sk), (qv, sv) = per_token(k), per_token(v)
    (pk, ck), (pv, cv) = per_pool(k), per_pool(v)
    return KVCache(qk, qv, sk, sv), KVCache(pk, pv, ck, cv)


def floats(cache: KVCache) -> tuple[jax.Array, jax.Array]:
    """The keys and values a pool of `pools` holds, float32 [H, L, pages, page_size, K]."""
    if cache.k_scale is None:
        return cache.k.astype(jnp.float32), cache.v.astype(jnp.float32)
    if cache.k_scale.ndim == 0:
        return cache.k * cache.k_scale, cache.v * cache.v_scale
    return tuple(
        dequantize(x, jnp.transpose(s, (2, 0, 1, 3)), jnp.float32) for x, s in zip(cache[:2], cache[2:], strict=True)
    )


def jax_layout(cache: KVCache) -> jax.Array:
    """[H, L, P, page, K] keys and values as JAX's kernel takes them, [L * P, page, 2H, K], a head's keys then its
    values."""
    H, L, P, size, K = cache.k.shape
    k, v = (jnp.transpose(x, (1, 2, 3, 0, 4)) for x in (cache.k, cache.v))  # [L, P, page, H, K]
    return jnp.stack([k, v], axis=4).reshape(L * P, size, 2 * H, K)


class Inputs(NamedTuple):
    """Every array the ways read, passed to their programs as arguments: closed over, JAX 0.10.2 writes each into
    the program as a constant (a pool of a GB made the chip's compiles outlast their calls)."""

    ours: KVCache  # meshlm's pool
    theirs: jax.Array  # the same keys and values as JAX's kernel takes them, [L * P, page, 2H, K]
    q: jax.Array  # [N, H, K]: the decode rows' queries, then the chunk's
    decode: jax.Array  # [R, n] the decode rows' pages
    chunk: jax.Array  # [1, m] the chunk's pages
    table: jax.Array  # [R (+1), max(n, m)] every row's pages, as JAX's kernel takes them
    lens: jax.Array  # [R (+1)] tokens each row holds
    starts: jax.Array  # [R + 1 (+1)] where each row's queries start in q


def inputs(ours: KVCache, theirs: KVCache, q: jax.Array, step: Step) -> Inputs:
    decode, chunk = step.tables()
    table = np.zeros((step.rows + bool(step.chunk), max(step.decode_pages, step.chunk_pages)), np.int32)
    table[: step.rows, : step.decode_pages] = decode
    table[step.rows :, : step.chunk_pages] = chunk
    lens = [step.context] * step.rows + ([step.done + step.chunk] if step.chunk else [])
    starts = list(range(step.rows + 1)) + ([step.rows + step.chunk] if step.chunk else [])
    arrays = (decode, chunk, table, np.array(lens, np.int32), np.array(starts, np.int32))
    return Inputs(ours, jax_layout(theirs), q, *(jnp.asarray(a) for a in arrays))


def ways(step: Step, scales: tuple[float, float] | None, blocks: tuple[int, int] | None) -> dict[str, Way]:
    """Each way's program of one layer's attention, given the layer and the inputs; `scales`: JAX's kernel's keys'
    and values' one scale each (an int8 pool), or None."""
    R = step.rows
    scale = 1.0  # q is drawn at the scale the scores want

    def meshlm(layer: jax.Array, x: Inputs) -> jax.Array:
        held = jnp.full((R,), step.context, jnp.int32)
        rows = CacheView(x.ours, x.decode, jnp.zeros((R, 1), jnp.int32), held)
        out = rows.attend(layer, x.q[:R, None], scale, "tpu")[:, 0]
        if not step.chunk:
            return out
        n = step.done + step.chunk
        view = CacheView(x.ours, x.chunk, jnp.zeros((1, step.chunk), jnp.int32), jnp.array([n], jnp.int32))
        keys, values = view.read(layer, x.q.dtype, whole_pages=True)
        at = step.done + jnp.arange(step.chunk)[:, None]
        allowed = (jnp.arange(keys.shape[1])[None] <= at)[None]
        attended = dense(Kernel("xla", "the chunk"), x.q[None, R:], keys, values, allowed, None, scale)
        return jnp.concatenate([out, attended[0]])

    k_scale, v_scale = scales or (None, None)
    if traced_backend() == "tpu":
        kernel = functools.partial(jax_ragged.ragged_paged_attention, num_kv_pages_per_block=blocks and blocks[0],
                                   num_queries_per_block=blocks and blocks[1])  # fmt: skip
    else:  # the kernel reshapes its buffers, which Pallas' TPU interpreter cannot: its reference checks the layout
        kernel = jax_ragged.ref_ragged_paged_attention

    def ragged(layer: jax.Array, x: Inputs) -> jax.Array:
        seqs = np.array([len(x.lens)], np.int32)  # concrete: the reference loops over it
        pages = x.ours.k.shape[2]
        return kernel(x.q, x.theirs, x.lens, x.table + layer * pages, x.starts, seqs, sm_scale=scale,
                      k_scale=k_scale, v_scale=v_scale)  # fmt: skip

    return {"meshlm": meshlm, "JAX ragged": ragged}


def reference(cache: KVCache, q: jax.Array, step: Step) -> jax.Array:
    """Layer 0's attention of q over the pages of `cache` as it holds them, in float32 at full precision."""
    k, v = floats(cache)
    H, K = k.shape[0], k.shape[-1]

    def attend(table: np.ndarray, queries: jax.Array, at: jax.Array) -> jax.Array:
        """queries [B, T, H, K] at positions `at` [T] over the rows' pages `table` [B, n]."""
        keys, values = (jnp.moveaxis(x[:, 0, table], 0, 3).reshape(*table.shape[:1], -1, H, K) for x in (k, v))
        scores = jnp.einsum("bthk,bshk->bhts", queries.astype(jnp.float32), keys, precision="highest")
        allowed = jnp.arange(keys.shape[1])[None] <= at[:, None]
        weights = jax.nn.softmax(jnp.where(allowed, scores, -jnp.inf), axis=-1)
        return jnp.einsum("bhts,bshk->bthk", weights, values, precision="highest")

    decode, chunk = step.tables()
    R = step.rows
    out = attend(decode, q[:R, None], jnp.array([step.context - 1]))[:, 0]
    if not step.chunk:
        return out
    return jnp.concatenate([out, attend(chunk, q[None, R:], step.done + jnp.arange(step.chunk))[0]])


def over_layers(way: Way, layers: int, x: Inputs) -> Callable[[], jax.Array]:
    """One program of `layers` layers' attention (each its own pages), summed so none is left out."""
    shape = jax.eval_shape(way, jnp.int32(0), x).shape

    @jax.jit
    def program(x: Inputs) -> jax.Array:
        body = lambda layer, total: total + way(layer, x).astype(jnp.float32)
        return jax.lax.fori_loop(0, layers, body, jnp.zeros(shape, jnp.float32))

    return lambda: jax.block_until_ready(program(x))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--page", type=int, default=128, help="tokens a page (meshlm's on a TPU: 128)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", type=int, default=15, help="decoding rows (the decode step has one more)")
    ap.add_argument("--context", type=int, default=2048, help="tokens each decoding row holds")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--done", type=int, default=768, help="the chunk's prompt tokens before it")
    ap.add_argument("--kv", default="bfloat16,int8", help="pool dtypes to measure")
    ap.add_argument(
        "--blocks", default="", help="JAX's kernel's (kv pages, queries) a block, e.g. 8,32 (default: its own)"
    )
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--copy-mb", type=int, default=1024)
    ap.add_argument("--tolerance", type=float, default=0.05, help="largest error against float32 attention")
    args = ap.parse_args()
    device = jax.devices()[0]
    print(f"JAX {jax.__version__} on {device.device_kind} ({device.platform}); load average {load_average()}")
    on_tpu = device.platform == "tpu"
    blocks = tuple(int(b) for b in args.blocks.split(",")) if args.blocks else None
    gbs = copy_gbs(args.copy_mb, args.repeats) if on_tpu else float("nan")
    copy = f"copy: {gbs:.1f} GB/s" if on_tpu else "not timed off a TPU"
    print(f"{copy}; heads {args.heads} x {args.head_dim}, pages of {args.page}, {args.layers} layers")
    steps = {
        "decode": Step(args.rows + 1, args.context, 0, 0, args.page),
        "mixed": Step(args.rows, args.context, args.chunk, args.done, args.page),
    }
    failed = []
    for kv in args.kv.split(","):
        for name, step in steps.items():
            failed += measure(f"{kv} pool, {name}", step, kv, args, blocks, gbs)
    if failed:
        sys.exit("wrong results: " + "; ".join(failed))


def measure(
    case: str, step: Step, kv: str, args: argparse.Namespace, blocks: tuple[int, int] | None, gbs: float
) -> list[str]:
    """Print each way's error and, on a TPU, its time a layer for one step; the ways that err too much. JAX's
    kernel may refuse the shapes on a TPU (Mosaic's error or XLA's): that is printed, and its time left out."""
    on_tpu = jax.devices()[0].platform == "tpu"
    read = step.tokens_read * 2 * args.heads * args.head_dim * (1 if kv == "int8" else 2)
    print(f"\n{case}: {step.rows} rows at {step.context} tokens"
          + (f" + a chunk of {step.chunk} after {step.done}" if step.chunk else "")
          + f" ({read / 1e6:.1f} MB of KV a layer)", flush=True)  # fmt: skip
    ours, theirs = pools(jax.random.key(0), args.heads, args.layers, step, args.head_dim, kv)
    shape = (step.rows + step.chunk, args.heads, args.head_dim)
    q = (jax.random.normal(jax.random.key(1), shape) / args.head_dim**0.5).astype(jnp.bfloat16)
    x = inputs(ours, theirs, q, step)
    scales = None if kv == "bfloat16" else (float(theirs.k_scale), float(theirs.v_scale))
    with contextlib.nullcontext() if on_tpu else pltpu.force_tpu_interpret_mode():
        programs = ways(step, scales, blocks)
        errors = {}
        for way, program in list(programs.items()):
            print(f"  {way}: compiling and checking one layer", flush=True)
            truth = reference(theirs if way == "JAX ragged" else ours, q, step)
            one_layer = jax.jit(program) if on_tpu else program  # the reference slices by the row starts eagerly
            try:
                errors[way] = float(jnp.max(jnp.abs(one_layer(jnp.int32(0), x).astype(jnp.float32) - truth)))
            except Exception as e:
                if not (on_tpu and way == "JAX ragged"):
                    raise
                print(f"  {way} refused: {type(e).__name__}: {str(e).strip().splitlines()[0][:300]}", flush=True)
                del programs[way]
        if not on_tpu:
            print("  largest error against float32 attention: " + ", ".join(f"{w} {e:.4f}" for w, e in errors.items()))
            return [f"{case} {w}: error {e:.4f}" for w, e in errors.items() if e > args.tolerance]
        times = best_times({w: over_layers(p, args.layers, x) for w, p in programs.items()}, args.repeats)
    for way, seconds in times.items():
        per_layer = seconds / args.layers
        share = read / per_layer / 1e9 / gbs
        print(f"  {way:11s} {per_layer * 1e6:8.1f} us a layer  {share:6.1%} of the copy's GB/s  "
              f"largest error {errors[way]:.4f}", flush=True)  # fmt: skip
    if len(times) == 2:
        print(f"  meshlm / JAX ragged: {times['meshlm'] / times['JAX ragged']:.2f}x")
    return [f"{case} {w}: error {e:.4f}" for w, e in errors.items() if e > args.tolerance]


if __name__ == "__main__":
    main()
