"""Packed documents never see each other: a row A|B|C|padding computes, for each document, the logits and
per-token losses it computes alone, on every architecture of the family and on a sharded mesh."""

import dataclasses

import jax
import numpy as np
import pytest

import meshlm
from meshlm import model

GPTJ = meshlm.ModelConfig(
    n_layer=2, d_model=64, n_head=4, d_ff=128, rotary_dim=8, vocab_size=256, n_vocab_used=250, max_seq_len=64
)
CONFIGS = {
    "gptj": GPTJ,
    "neox": dataclasses.replace(
        GPTJ, residual="parallel_two_norms", rotary_style="half", qkv_bias=True, out_bias=True, head_bias=False
    ),
    # GPT-Neo: learned positions, and a local window shorter than the documents, so it clips inside them
    "neo": dataclasses.replace(
        GPTJ,
        rotary_dim=0,
        residual="sequential",
        position="learned",
        attention_layers=("global", "local"),
        local_window=3,
        scale_attn=False,
        out_bias=True,
        tie_embeddings=True,
        head_bias=False,
    ),
    # the seed's `pe: fixed` (a learned table) with its rmsnorm, and its t5 relative bias
    "seed-fixed": dataclasses.replace(GPTJ, rotary_dim=0, position="learned", norm="rmsnorm"),
    "seed-t5": dataclasses.replace(GPTJ, rotary_dim=0, position="t5", norm="scalenorm"),
}
LENGTHS = [(6, 9, 5), (4, 4, 12), (10, 3, 7), (2, 8, 8)]  # three documents per row, then padding
ROW = 24  # tokens per row (targets included)


def packed_rows(seed: int = 0) -> tuple[np.ndarray, np.ndarray, list[list[np.ndarray]]]:
    """Rows [4, ROW] of three packed documents each and padding (segment 0), with the documents."""
    rng = np.random.default_rng(seed)
    tokens, segments = np.zeros((len(LENGTHS), ROW), np.int32), np.zeros((len(LENGTHS), ROW), np.int32)
    docs = []
    for r, lengths in enumerate(LENGTHS):
        row_docs, start = [], 0
        for s, n in enumerate(lengths, start=1):
            doc = rng.integers(0, 250, n).astype(np.int32)
            tokens[r, start : start + n], segments[r, start : start + n] = doc, s
            row_docs.append(doc)
            start += n
        docs.append(row_docs)
    return tokens, segments, docs


def outputs(params, tokens, segments, cfg):
    """(logits [B, T, V], per-target nll [B, T]) of rows [B, T + 1] with their segment ids."""
    logits = model.unembed(params, model.hidden_states(params, tokens[:, :-1], cfg, segments=segments[:, :-1]), cfg)
    return logits, model.target_nll(params, tokens, cfg, segments=segments)[0]


def run(params, tokens, segments, cfg):
    return tuple(np.asarray(a) for a in jax.jit(outputs, static_argnums=3)(params, tokens, segments, cfg))


@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIGS)
def test_a_packed_document_computes_what_it_computes_alone(name):
    cfg = CONFIGS[name]
    params = model.init(cfg, jax.random.key(1))
    tokens, segments, docs = packed_rows()
    logits, nll = run(params, tokens, segments, cfg)
    for r, row_docs in enumerate(docs):
        start = 0
        for doc in row_docs:
            alone_logits, alone_nll = (a[0] for a in run(params, doc[None], np.ones((1, len(doc)), np.int32), cfg))
            end = start + len(doc) - 1  # the document's last token is only a target
            np.testing.assert_allclose(logits[r, start:end], alone_logits, atol=1e-5, rtol=0)
            np.testing.assert_allclose(nll[r, start:end], alone_nll, atol=1e-5, rtol=0)
            start += len(doc)


@pytest.mark.parametrize("name", ["gptj", "neo"])
def test_changing_one_document_leaves_the_next_bit_identical(name):
    cfg = CONFIGS[name]
    params = model.init(cfg, jax.random.key(2))
    tokens, segments, _ = packed_rows()
    changed = tokens.copy()
    first = segments == 1
    changed[first] = (changed[first] + 17) % 250
    before, _ = run(params, tokens, segments, cfg)
    after, _ = run(params, changed, segments, cfg)
    later = segments[:, :-1] >= 2
    np.testing.assert_array_equal(after[later], before[later])
    assert not np.allclose(after[segments[:, :-1] == 1], before[segments[:, :-1] == 1])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gptj", "neox", "neo", "seed-fixed"])
def test_packing_on_a_sharded_mesh_gives_the_single_device_numbers(name):
    cfg = CONFIGS[name]
    tokens, segments, _ = packed_rows(seed=3)
    want_logits, want_nll = run(meshlm.from_config(cfg, seed=4).params, tokens, segments, cfg)
    lm = meshlm.from_config(cfg, mesh="data=2,fsdp=2,model=2", seed=4)
    with jax.set_mesh(lm.mesh):
        logits, nll = run(lm.params, tokens, segments, cfg)
    real = segments[:, :-1] > 0
    np.testing.assert_allclose(logits[real], want_logits[real], atol=1e-5, rtol=0)
    np.testing.assert_allclose(nll[real], want_nll[real], atol=1e-5, rtol=0)
