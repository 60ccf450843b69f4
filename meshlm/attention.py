"""Which attention kernel runs, decided in one place, and the TPU splash kernel's call.

`resolve` is the one function of the backend, the shapes, the dtype, the layer's kind and the phase
(a training or scoring forward pass, a prefill over the paged cache, a decode step) that names the
kernel; the model runs what it names. Every kernel's limits are written here and nowhere else:

- `splash`: TPU (`jax.experimental.pallas.ops.tpu.splash_attention`; Pallas' interpreter elsewhere, with
  `attention: splash`). Serves a forward pass without the cache (training, scoring): causal global layers,
  local windows, packed documents by segment ids. Limits: no additive bias (t5); queries and keys of one
  length, a multiple of 128 (its lane width); float32 or bfloat16; rows and heads divisible by their
  mesh axes (it runs per shard).
- `cudnn`: GPU (`jax.nn.dot_product_attention(implementation="cudnn")`). Any phase over contiguous keys,
  with the mask and a bias. float16 / bfloat16 under "auto"; what cuDNN refuses falls back to XLA.
- `paged_tpu`: TPU (meshlm's own Mosaic kernel, `meshlm.paged_attention`). Decode steps (one query per row)
  read in place from the paged pool. Limits: bfloat16 or int8 pools (the ones measured on a chip; a float32
  model's pool is gathered); head sizes of a multiple of 128: a pool of heads of 64 (Pythia's, GPT-Neo's), bf16
  or int8, takes a layout of XLA's own (pages minor), so the decode program would copy the whole pool to the
  kernel's every step (the kernel alone reads such pages 2.3-4.4x faster than the gather, measured on a v5e); no
  bias, no local window.
- `paged_gpu`: GPU (`jax.experimental.pallas.ops.gpu.paged_attention`; interpreted on a CPU with
  `attention: pallas`). Decode steps, as above. Limits: no bias, no local window.
- `xla`: everywhere, everything: einsum-softmax-einsum with float32 scores over a [B, T, S] mask, whose
  memory grows with T * S.

A prefill over the paged cache runs on XLA (or cuDNN): its queries start at each row's own cached
length, an offset the splash kernel needs fixed when it is built.

`Policy.attention` says what to prefer: "auto" takes the fastest kernel that serves the call; "xla",
"cudnn" force one; "pallas" the paged kernels for decode steps on any backend; "splash" the splash
kernel wherever its limits allow, interpreted off a TPU (slow: for checking it, as the tests do).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from meshlm.sharding import spec_for, traced_backend

PHASES = ("train", "prefill", "decode")  # a forward pass without the cache; a prompt over the cache; one token
KINDS = ("global", "local")  # causal over every earlier token; causal within a window
TPU_LANES = 128  # a TPU vector's lanes: splash tiles sequences in multiples of it, the paged kernel heads
SPLASH_BLOCKS = (512, 256, 128)  # the largest that divides the sequence is the block
SPLASH_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class Kernel:
    """The kernel a call runs and why. `interpret`: the Pallas kernel runs in its interpreter (off its chip)."""

    name: str  # "splash", "cudnn", "paged_tpu", "paged_gpu" or "xla"
    reason: str
    interpret: bool = False
    block: int = 0  # splash's tile along the sequence

    @property
    def paged(self) -> bool:
        return self.name.startswith("paged_")


def resolve(
    *,
    phase: str,
    kind: str,
    impl: str = "auto",
    backend: str | None = None,
    batch: int = 1,
    q_len: int,
    kv_len: int,
    heads: int,
    head_dim: int,
    dtype: str,
    biased: bool = False,
    shards: tuple[int, int] = (1, 1),
) -> Kernel:
    """The kernel for one attention call (see the module docstring for the table this encodes).

    `phase` one of PHASES, `kind` one of KINDS, `impl` the policy's preference, `backend` the traced
    program's (`sharding.traced_backend`) when None, `dtype` the compute dtype's name (a decode step's
    pool is stored in it), `biased` whether the scores carry an additive bias (the seed's t5 positions),
    `shards` how many ways the mesh splits rows (data x fsdp) and heads (model). Splash and its backward
    pass compile for a TPU v5e at head sizes 64, 80, 128 and 256 (tests/test_attention.py); the TPU
    paged kernel only at multiples of 128."""
    if phase not in PHASES or kind not in KINDS:
        raise ValueError(f"attention phase {phase!r} / kind {kind!r}: phases are {PHASES}, kinds {KINDS}")
    backend = backend or traced_backend()
    if phase == "decode" and impl != "xla" and impl != "cudnn":
        if biased or kind == "local":
            why = "an additive bias" if biased else "a local window"
            return _contiguous(impl, backend, dtype, f"the paged kernels take no {why}; the pool is gathered")
        if backend == "tpu" and impl in ("auto", "pallas"):
            if head_dim % TPU_LANES:
                why = f"heads of a multiple of {TPU_LANES} lanes (measured on a chip), not {head_dim}"
                return _contiguous(impl, backend, dtype, f"the TPU paged kernel serves {why}; the pool is gathered")
            if dtype in ("bfloat16", "int8"):
                return Kernel("paged_tpu", f"decode step on a TPU over a {dtype} pool")
            why = f"the TPU paged kernel serves bfloat16 and int8 pools (measured on a chip), not {dtype}"
            return _contiguous(impl, backend, dtype, why)
        if (backend == "gpu" and impl == "auto") or impl == "pallas":
            return Kernel("paged_gpu", f"decode step, attention {impl!r} on {backend}", interpret=backend == "cpu")
    if phase == "train" and (impl == "splash" or (impl == "auto" and backend == "tpu")):
        refusal = splash_refusal(batch, q_len, kv_len, heads, dtype, biased, shards)
        if refusal is None:
            block = next(b for b in SPLASH_BLOCKS if q_len % b == 0)
            return Kernel("splash", f"{kind} causal attention on {backend}", interpret=backend != "tpu", block=block)
        return _contiguous(impl, backend, dtype, f"splash cannot serve this call: {refusal}")
    if phase == "prefill" and impl in ("auto", "splash") and backend == "tpu":
        return _contiguous(impl, backend, dtype, "a prefill over the cache starts at each row's own length")
    return _contiguous(impl, backend, dtype, f"{phase} on {backend}, attention {impl!r}")


def splash_refusal(
    batch: int, q_len: int, kv_len: int, heads: int, dtype: str, biased: bool, shards: tuple[int, int]
) -> str | None:
    """Why the splash kernel cannot take a call with these shapes (None: it can)."""
    if biased:
        return "the scores carry an additive bias (t5 positions)"
    if q_len != kv_len:
        return f"queries ({q_len}) and keys ({kv_len}) differ in length"
    if q_len % TPU_LANES:
        return f"sequence length {q_len} is not a multiple of {TPU_LANES}"
    if dtype not in SPLASH_DTYPES:
        return f"dtype {dtype} (it takes {' or '.join(SPLASH_DTYPES)})"
    rows, model = shards
    if batch % rows or heads % model:
        return f"{batch} rows / {heads} heads do not split evenly over {rows} / {model} shards"
    return None


def _contiguous(impl: str, backend: str, dtype: str, why: str) -> Kernel:
    """cuDNN where asked, or on a GPU in half precision with "auto"; XLA otherwise."""
    if impl == "cudnn":
        return Kernel("cudnn", f"{why}; cuDNN as asked")
    if impl == "auto" and backend == "gpu" and dtype in ("bfloat16", "float16"):
        return Kernel("cudnn", f"{why}; cuDNN on a GPU in {dtype} (XLA where it refuses)")
    return Kernel("xla", f"{why}; XLA")


def mesh_shards() -> tuple[int, int]:
    """How many ways the current mesh splits rows (the batch axes) and heads: (1, 1) without one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1, 1

    def size(rule: object) -> int:
        names = () if rule is None else (rule,) if isinstance(rule, str) else rule
        return int(np.prod([mesh.shape[n] for n in names if n in mesh.shape], dtype=int))

    batch, heads = spec_for(("batch", "act_heads"))
    return size(batch), size(heads)


# ---------------------------------------------------------------------------------------------------
# The contiguous kernels: XLA's and cuDNN's


def dense(
    kernel: Kernel,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    allowed: jax.Array,
    bias: jax.Array | None,
    scale: float,
    strict: bool = False,
) -> jax.Array:
    """Softmax attention with fp32 scores over contiguous keys. q [B, T, H, K], k/v [B, S, H, K], allowed
    [B, T, S], bias [B, H, T, S] or None. `jax.nn.dot_product_attention` either way: its XLA path is the
    plain einsum-softmax-einsum; cuDNN's fuses it into one kernel (the mask becomes an additive bias).
    A cuDNN refusal falls back to XLA unless `strict` (attention "cudnn" asked for it)."""
    mask = allowed[:, None]
    if kernel.name == "cudnn":
        try:
            return jax.nn.dot_product_attention(q, k, v, bias, mask, scale=scale, implementation="cudnn")
        except (NotImplementedError, ValueError, RuntimeError):
            if strict:
                raise
    return jax.nn.dot_product_attention(q, k, v, bias, mask, scale=scale, implementation="xla")


# ---------------------------------------------------------------------------------------------------
# The splash kernel


def _splash_kernel(length: int, heads: int, window: int, block: int, interpret: bool):
    """The splash kernel for [heads, length, head_dim] queries: causal, or (window > 0) causal within
    `window` tokens (a key `window` or more tokens back is out, as `local_window` counts)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    shape = (length, length)
    head = sa.LocalMask(shape, (window - 1, 0), 0) if window else sa.CausalMask(shape)
    sizes = sa.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    mask = sa.MultiHeadMask([head] * heads)
    # Built inside the caller's trace: the mask's block tables (numpy, cached by splash's `_process_mask`) become
    # the program's constants. Made eagerly, they went to the default device, which a TPU topology's plan
    # (`meshlm plan --target tpu:...`) cannot run on.
    return sa.make_splash_mha_single_device(mask, block_sizes=sizes, interpret=interpret)


def splash(
    kernel: Kernel, q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None, scale: float, window: int
) -> jax.Array:
    """Causal attention (within `window` tokens where > 0) of q, k, v [B, T, H, K] by the splash kernel;
    `segments` [B, T] (or None): a token sees only tokens of its own segment id. Scores in float32;
    the scale is applied to q. Under a mesh the kernel runs per shard: rows over the batch axes, heads
    over `model`."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    T = q.shape[1]

    def call(q: jax.Array, k: jax.Array, v: jax.Array, *ids: jax.Array) -> jax.Array:
        run = _splash_kernel(T, q.shape[2], window, kernel.block, kernel.interpret)
        q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))  # [B, H, T, K], as the kernel reads them
        if ids:
            out = jax.vmap(lambda q, k, v, i: run(q, k, v, segment_ids=sa.SegmentIds(i, i)))(q, k, v, *ids)
        else:
            out = jax.vmap(run)(q, k, v)
        return jnp.swapaxes(out, 1, 2)

    q = (q * jnp.asarray(scale, jnp.float32)).astype(q.dtype) if scale != 1.0 else q
    ids = () if segments is None else (segments.astype(jnp.int32),)
    if jax.sharding.get_abstract_mesh().empty:
        return call(q, k, v, *ids)
    rows = spec_for(("batch", None, "act_heads", None))
    return jax.shard_map(
        call,
        in_specs=(rows, rows, rows) + (spec_for(("batch", None)),) * len(ids),
        out_specs=rows,
        check_vma=False,  # the kernel declares no varying axes; each shard's rows and heads are its own
    )(q, k, v, *ids)
