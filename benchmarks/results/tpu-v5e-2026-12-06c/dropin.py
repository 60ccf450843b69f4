"""The fused_rows body as a drop-in for meshlm.paged_attention._int8_tpu_kernel (checked by kvariants.py)."""
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def _int8_tpu_kernel(lengths_ref, table_ref, q_ref, k_ref, v_ref, ks_ref, vs_ref, o_ref, m_ref, l_ref, acc_ref):
    """Program (b, j): page j of row b, every head. Keys [H, page_size, K] int8 and their scales [H, page_size]
    in; each product one matmul over all heads with the page as the MXU's weights (scores: the queries [H, K]
    against all heads' keys [H * page_size, K], head h's row its own block of lanes; values: the block-diagonal
    weights [H, H * page_size] against all heads' values), an online softmax's running max (m), sum (l) and
    weighted values (acc) updated; row b's output from them after its last page. Pages past the row's length are
    neither read (their block index repeats the last page's) nor computed."""
    b, j = pl.program_id(0), pl.program_id(1)
    H, size, K = k_ref.shape
    length = lengths_ref[b]

    @pl.when(j == 0)
    def _start() -> None:
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(j * size < length)
    def _page() -> None:
        dtype = q_ref.dtype
        exact = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else jax.lax.Precision.DEFAULT
        keys = k_ref[...].reshape(H * size, K).astype(dtype)
        every = jax.lax.dot_general(q_ref[...], keys, (((1,), (1,)), ((), ())), precision=exact,
                                    preferred_element_type=jnp.float32)  # fmt: skip  [H, H * size]
        head = jax.lax.broadcasted_iota(jnp.int32, (H, size), 0)
        scores = jnp.zeros((H, size), jnp.float32)
        for h in range(H):  # head h's scores: row h of its own block of lanes
            scores = jnp.where(head == h, every[:, h * size : (h + 1) * size], scores)
        held = j * size + jax.lax.broadcasted_iota(jnp.int32, (1, size), 1) < length
        scores = jnp.where(held, scores * ks_ref[...], -jnp.inf)  # [H, page_size]
        m_prev = m_ref[...]  # [H, 128], its lanes equal
        m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1, keepdims=True))
        p = jnp.exp(scores - m_next[:, :1])
        alpha = jnp.exp(m_prev - m_next)
        m_ref[...], l_ref[...] = m_next, alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
        weights = jnp.where(held, p * vs_ref[...], 0.0)
        blocks = jnp.concatenate([jnp.where(head == h, weights, 0.0) for h in range(H)], axis=1)  # [H, H * size]
        values = v_ref[...].reshape(H * size, K).astype(dtype)
        out = jax.lax.dot_general(blocks.astype(dtype), values, (((1,), (0,)), ((), ())), precision=exact,
                                  preferred_element_type=jnp.float32)  # fmt: skip  [H, K]
        acc_ref[...] = alpha[:, :1] * acc_ref[...] + out

    @pl.when(j == pl.num_programs(1) - 1)
    def _finish() -> None:
        total = l_ref[:, :1]
        o_ref[...] = jnp.where(total > 0, acc_ref[...] / jnp.where(total > 0, total, 1.0), 0.0).astype(o_ref.dtype)
