"""Generation: KV-cache decoding against the full forward, greedy decoding against transformers' generate,
the sampling filters on hand-computed cases (and against transformers' warpers), seeds, stops, `meshlm sample`."""

import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

import meshlm
from meshlm import cli, config, kv_cache, model
from meshlm.serve import sampler as gen
from meshlm.serve.batch import settings_for
from meshlm.serve.params import SamplingParams
from tests.helpers.generation import NEW, greedy, hf_greedy

PROMPT_LENGTHS = (9, 3, 14)  # a padded batch: rows of different lengths, left-padded to one bucket


@pytest.fixture(scope="module")
def lm(hf_tiny):
    return meshlm.load(hf_tiny.path)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return [rng.integers(1, 512, n).tolist() for n in PROMPT_LENGTHS]


@pytest.mark.slow
def test_greedy_matches_transformers_for_one_prompt_and_a_padded_batch(lm, hf_tiny, prompts):
    penalties = (1.0, 1.0, 1.5)  # per-row settings: the last row also checks the repetition penalty
    expected = [hf_greedy(hf_tiny, p, NEW, repetition_penalty=r) for p, r in zip(prompts, penalties, strict=True)]

    (alone,) = lm.generate_tokens([prompts[0]], greedy())
    assert alone.tokens == expected[0][0]
    assert alone.finish_reason == "length"

    batch = lm.generate_tokens(prompts, [greedy(repetition_penalty=r) for r in penalties])
    for got, (tokens, logits) in zip(batch, expected, strict=True):
        assert len(got.tokens) == NEW and got.tokens == tokens
        # log-probabilities are the model's own (before any penalty or filter), as transformers reports them
        want = torch.log_softmax(torch.as_tensor(logits), -1).numpy()[np.arange(NEW), tokens]
        np.testing.assert_allclose(got.logprobs, want, atol=1e-4)


@pytest.mark.slow
def test_greedy_on_a_multi_device_mesh_matches_one_device(lm, hf_tiny, prompts):
    sharded = meshlm.load(hf_tiny.path, mesh="data=2,fsdp=2,model=2")
    params = [greedy(24)] * len(prompts)
    assert [c.tokens for c in sharded.generate_tokens(prompts, params)] == [
        c.tokens for c in lm.generate_tokens(prompts, params)
    ]


@pytest.mark.parametrize("attention", ["xla", "pallas"])
def test_paged_decoding_logits_equal_the_full_forward_at_every_step(lm, attention):
    """Two rows whose pages lie scattered over the pool in no order, the second reusing the first's
    opening page (a cached prefix, so its prefill starts after it): every prompt position's and every
    decode step's logits equal the full forward's (fp32), with decode steps reading the pages by XLA's
    gather or by the Pallas paged-attention kernel (interpreted here)."""
    cfg, params, policy = lm.config, lm.params, model.Policy(attention=attention)
    rng = np.random.default_rng(0)
    size, total, prompt_len = 4, 22, 7
    opening = rng.integers(0, cfg.vocab_size, size)
    seqs = [np.concatenate([opening, rng.integers(0, cfg.vocab_size, total - size)]) for _ in range(2)]
    expected = np.asarray(jax.jit(lambda p, t: model.forward(p, t, cfg))(params, np.stack(seqs)))

    cache = kv_cache.init_cache(cfg, 16, size)
    table = np.array([[5, 2, 11, 7, 3, 13], [5, 9, 14, 1, 12, 4]], np.int32)  # page 5 shared
    start = np.array([0, size], np.int32)  # row 1's opening page is already written (by row 0)
    prompt = np.zeros((2, prompt_len), np.int32)
    mask = np.zeros((2, prompt_len), bool)
    prompt[0], mask[0] = seqs[0][:prompt_len], True
    n1 = prompt_len - size
    prompt[1, :n1], mask[1, :n1] = seqs[1][size:prompt_len], True  # right padding after it
    decode = jax.jit(lambda p, t, c, tb, n, m: model.decode(p, t, c, tb, n, cfg, policy, mask=m))
    logits, cache = decode(params, prompt, cache, table, start, mask)
    np.testing.assert_allclose(logits[0], expected[0, :prompt_len], atol=1e-5, rtol=0)
    np.testing.assert_allclose(logits[1, :n1], expected[1, size:prompt_len], atol=1e-5, rtol=0)
    for pos in range(prompt_len, total):
        new = np.array([[s[pos]] for s in seqs], np.int32)
        logits, cache = decode(params, new, cache, table, np.full(2, pos, np.int32), np.ones((2, 1), bool))
        np.testing.assert_allclose(logits[:, 0], expected[:, pos], atol=1e-5, rtol=0)


@pytest.mark.parametrize("attention", ["xla", "pallas"])
def test_a_mixed_call_of_a_prompts_chunk_and_decoding_rows_equals_the_full_forward(lm, attention):
    """One pass over the layers (`model.decode_spans`) that prefills a chunk of one row's prompt and decodes a
    token of two others, whose pages interleave in the pool: each span's logits equal the full forward's (fp32),
    and the pool holds what the two calls apart write (the decode rows by the paged kernel with "pallas")."""
    cfg, params, policy = lm.config, lm.params, model.Policy(attention=attention)
    rng = np.random.default_rng(1)
    size, total = 4, 16
    seqs = rng.integers(0, cfg.vocab_size, (3, total))
    expected = np.asarray(jax.jit(lambda p, t: model.forward(p, t, cfg))(params, seqs))
    table = np.array([[3, 8, 1, 12], [6, 2, 10, 4], [9, 5, 11, 7]], np.int32)
    held = np.array([4, 9, 7], np.int32)  # row 0 has a page of its prompt; rows 1 and 2 decode after theirs
    cache = kv_cache.init_cache(cfg, 16, size)
    prefill = jax.jit(lambda p, t, c, tb, n, m: model.decode(p, t, c, tb, n, cfg, policy, mask=m))
    first = np.zeros((3, 12), np.int32)
    mask = np.arange(12) < held[:, None]
    for i in range(3):
        first[i, : held[i]] = seqs[i, : held[i]]
    _, cache = prefill(params, first, cache, table, np.zeros(3, np.int32), mask)

    chunk = model.Span(jnp.asarray(seqs[:1, 4:12]), table[:1], held[:1], whole_pages=True)
    step = model.Span(jnp.asarray(np.stack([seqs[1, 9:10], seqs[2, 7:8]])), table[1:], held[1:])
    spans = jax.jit(lambda p, c: model.decode_spans(p, (chunk, step), c, cfg, policy))
    (x_chunk, x_step), mixed = spans(params, cache)
    head = lambda x: np.asarray(model.unembed(params, x, cfg))
    np.testing.assert_allclose(head(x_chunk)[0], expected[0, 4:12], atol=1e-5, rtol=0)
    np.testing.assert_allclose(head(x_step)[:, 0], expected[[1, 2], [9, 7]], atol=1e-5, rtol=0)

    apart = cache
    for span in (chunk, step):
        _, apart = jax.jit(lambda p, c, s=span: model.decode_spans(p, (s,), c, cfg, policy))(params, apart)
    for got, want in zip(mixed[:2], apart[:2], strict=True):  # keys and values (a float pool has no scales)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=0)


MIXED_VARIANTS = {  # what a mixed call's spans each keep their own: learned positions and local windows, a t5 bias
    "gpt-neo": (config.preset("gpt-neo-125m").replace(n_layer=2, d_model=64, n_head=2, d_ff=128, vocab_size=512,
                                                        n_vocab_used=500, max_seq_len=64, local_window=5), None),
    "t5": (config.preset("test-tiny").replace(position="t5", rotary_dim=0), None),
    "int8 pool": (config.preset("test-tiny"), "int8"),
}  # fmt: skip


@pytest.mark.parametrize("variant", sorted(MIXED_VARIANTS))
def test_a_mixed_call_gives_each_span_what_it_gives_alone(variant):
    """`model.decode_spans` of a prompt's 8-token chunk and a decode step of two rows against each span run alone,
    for the family's other position schemes and attention windows and over an int8 pool: the same hidden states,
    and the same pool after."""
    cfg, kv = MIXED_VARIANTS[variant]
    policy = model.Policy(kv_cache_dtype=kv)
    params = model.init(cfg, jax.random.key(0))
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, cfg.n_vocab_used, (3, 16))
    table = np.array([[3, 8, 1, 12], [6, 2, 10, 4], [9, 5, 11, 7]], np.int32)
    held = np.array([4, 9, 7], np.int32)
    cache = kv_cache.init_cache(cfg, 16, 4, policy.kv_dtype)
    first = np.where(np.arange(12) < held[:, None], tokens[:, :12], 0)
    opening = model.Span(jnp.asarray(first), table, np.zeros(3, np.int32), jnp.asarray(np.arange(12) < held[:, None]))
    [_], cache = model.decode_spans(params, (opening,), cache, cfg, policy)
    chunk = model.Span(jnp.asarray(tokens[:1, 4:12]), table[:1], held[:1], whole_pages=True)
    step = model.Span(jnp.asarray(np.stack([tokens[1, 9:10], tokens[2, 7:8]])), table[1:], held[1:])
    run = lambda c, *spans: jax.jit(lambda c: model.decode_spans(params, spans, c, cfg, policy))(c)
    (x_chunk, x_step), mixed = run(cache, chunk, step)
    [alone_chunk], apart = run(cache, chunk)
    [alone_step], apart = run(apart, step)
    np.testing.assert_allclose(x_chunk, alone_chunk, atol=1e-5, rtol=0)
    np.testing.assert_allclose(x_step, alone_step, atol=1e-5, rtol=0)
    for got, want in zip(mixed, apart, strict=True):
        if want is not None:
            np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=1e-6, rtol=0)


@pytest.mark.slow
def test_sampling_is_reproducible_by_seed_whatever_the_batch(lm, prompts):
    sampled = SamplingParams(max_new_tokens=NEW, temperature=0.9, top_k=50, top_p=0.95, seed=7)
    (alone,) = lm.generate_tokens([prompts[0]], sampled)
    batch = lm.generate_tokens(prompts, [sampled.replace(seed=s) for s in (7, 8, 9)])
    again = lm.generate_tokens(prompts, [sampled.replace(seed=s) for s in (7, 8, 9)])
    assert batch[0].tokens == alone.tokens
    assert [c.tokens for c in batch] == [c.tokens for c in again]
    (other,) = lm.generate_tokens([prompts[0]], sampled.replace(seed=8))
    assert other.tokens != alone.tokens
    greedy_tokens = lm.generate_tokens([prompts[0]], greedy())[0].tokens
    assert alone.tokens != greedy_tokens
    # filters that leave one candidate turn sampling into greedy decoding
    (top1,) = lm.generate_tokens([prompts[0]], sampled.replace(top_k=1))
    (tiny_p,) = lm.generate_tokens([prompts[0]], sampled.replace(top_k=0, top_p=1e-6))
    assert top1.tokens == greedy_tokens == tiny_p.tokens


def test_stop_token_ids_end_a_row_without_emitting_the_stop_token(lm, prompts):
    free = lm.generate_tokens(prompts, greedy())
    stop = free[0].tokens[5]
    stopped = lm.generate_tokens(prompts, greedy(stop_token_ids=(stop,)))
    for f, s in zip(free, stopped, strict=True):
        cut = f.tokens.index(stop) if stop in f.tokens else NEW
        assert s.tokens == f.tokens[:cut]
        assert s.finish_reason == ("stop" if cut < NEW else "length")


def rows_of(*values):
    return jnp.asarray(np.array(values, np.float32))


def test_top_k_keeps_the_k_largest_per_row():
    logits = rows_of([1.0, 3.0, 2.0, 0.0], [1.0, 3.0, 2.0, 0.0])
    out = np.asarray(gen.top_k_filter(logits, jnp.array([2, 0])))
    np.testing.assert_array_equal(out[0], [-np.inf, 3.0, 2.0, -np.inf])
    np.testing.assert_array_equal(out[1], [1.0, 3.0, 2.0, 0.0])


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = jnp.log(rows_of([0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]))
    out = np.asarray(gen.top_p_filter(logits, jnp.array([0.8, 0.81, 0.5])))
    assert np.isfinite(out).tolist() == [
        [True, True, False, False],  # 0.5 + 0.3 reaches 0.8
        [True, True, True, False],  # 0.8 does not reach 0.81
        [False, False, False, True],  # the most likely token alone reaches 0.5
    ]


def test_temperature_then_top_k_then_top_p():
    scaled = gen.apply_temperature(rows_of([2.0, 0.0], [2.0, 0.0]), jnp.array([0.5, 0.0]))
    np.testing.assert_allclose(scaled, [[4, 0], [2, 0]])  # temperature 0 (greedy) leaves the logits alone
    base = jnp.log(rows_of([0.6, 0.3, 0.1]))
    # top_p 0.7 keeps two tokens at temperature 1; temperature 0.25 first sharpens to (0.941, 0.059, ~0): one
    keep = lambda t, k, p: np.isfinite(gen.filter_logits(base, jnp.array([t]), jnp.array([k]), jnp.array([p])))
    assert keep(1.0, 0, 0.7).tolist() == [[True, True, False]]
    assert keep(0.25, 0, 0.7).tolist() == [[True, False, False]]
    # top-p sees the distribution renormalised after top-k: (0.4, 0.3 | 0.2, 0.1) -> (0.57, 0.43), so p=0.5
    # keeps one token (without top-k first it would keep 0.4 and 0.3)
    four = jnp.log(rows_of([0.4, 0.3, 0.2, 0.1]))
    after = np.isfinite(gen.filter_logits(four, jnp.array([1.0]), jnp.array([2]), jnp.array([0.5])))
    assert after.tolist() == [[True, False, False, False]]
    assert np.isfinite(gen.filter_logits(four, jnp.array([1.0]), jnp.array([0]), jnp.array([0.5]))).sum() == 2


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = rows_of([2.0, -2.0, 1.0])
    seen = jnp.array([[True, True, False]])
    np.testing.assert_allclose(gen.repetition_penalty(logits, seen, jnp.array([2.0])), [[1.0, -4.0, 1.0]])


def test_filters_agree_with_transformers_warpers():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (4, 200)).astype(np.float32)
    ks, ps = [1, 5, 37, 199], [0.05, 0.5, 0.9, 0.99]
    got_k = np.asarray(gen.top_k_filter(jnp.asarray(logits), jnp.array(ks)))
    got_p = np.asarray(gen.top_p_filter(jnp.asarray(logits), jnp.array(ps)))
    for i in range(4):
        row = torch.as_tensor(logits[i : i + 1])
        want_k = TopKLogitsWarper(ks[i])(None, row.clone()).numpy()[0]
        want_p = TopPLogitsWarper(ps[i])(None, row.clone()).numpy()[0]
        np.testing.assert_array_equal(np.isfinite(got_k[i]), np.isfinite(want_k))
        np.testing.assert_array_equal(np.isfinite(got_p[i]), np.isfinite(want_p))


def test_candidate_thresholds_keep_what_the_exact_filters_keep():
    """Top-k and top-p read their thresholds off each row's 256 largest logits; on a 50400-wide vocabulary
    they keep exactly the tokens the bisection filters keep: rows whose nucleus lies among the candidates,
    rows whose candidates hold less than p (the exact fallback) and k beyond the candidates."""
    rng = np.random.default_rng(0)
    peaked, flat = rng.normal(0, 4, (4, 50400)), rng.normal(0, 0.5, (4, 50400))
    logits = jnp.asarray(np.concatenate([peaked, flat]).astype(np.float32))
    ks = jnp.array([0, 1, 40, 1000, 0, 7, 300, 0])
    ps = jnp.array([0.9, 1.0, 0.5, 0.8, 0.99, 0.3, 1.0, 0.6], jnp.float32)
    got = np.isfinite(gen.filter_logits(logits, jnp.ones(8), ks, ps))
    want = np.isfinite(gen.top_p_filter(gen.top_k_filter(logits, ks), ps))
    np.testing.assert_array_equal(got, want)
    top = np.sort(np.asarray(gen.top_k_filter(logits, ks)), axis=-1)[:, ::-1]
    probs = np.exp(top - top.max(-1, keepdims=True))
    covered = probs[:, : gen.CANDIDATES].sum(-1) / probs.sum(-1) >= np.asarray(ps)
    assert covered[[0, 2, 3]].all() and not covered[[4, 7]].any()  # both ways of finding the nucleus ran
    assert 1 < want[0].sum() < gen.CANDIDATES and want[3].sum() <= 1000


def test_padded_vocabulary_rows_are_never_produced(lm):
    V, used = 64, 50
    logits = np.zeros((3, V), np.float32)
    logits[:, used:] = 100.0  # the padded rows would win every time
    settings = settings_for(
        [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1), SamplingParams(top_k=3, seed=2)], 3
    )
    seen, count = jnp.zeros((3, V), bool), jnp.zeros(3, jnp.int32)
    token, logprob, top_ids, _ = gen.choose(jnp.asarray(logits), seen, count, settings, used)
    assert (np.asarray(token) < used).all() and (np.asarray(top_ids) < used).all()
    np.testing.assert_allclose(logprob, -np.log(used), rtol=1e-5)


def test_settings_are_validated_with_clear_messages():
    for bad, words in [
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=1.5), "top_k"),
        (dict(stop=("",)), "stop"),
    ]:
        with pytest.raises(ValueError, match=words):
            SamplingParams(**bad)


# ---------------------------------------------------------------------------------------------------
# Text: a tiny model with GPT-J's vocabulary and the real GPT-2 tokenizer


@pytest.fixture(scope="module")
def text_lm(hf_tiny_gpt2_vocab, gpt2_bpe_file):
    return meshlm.load(hf_tiny_gpt2_vocab.path, tokenizer=gpt2_bpe_file)


TEXTS = ["Hello world, this is", "The quick brown fox"]


@pytest.mark.slow
def test_generate_text_and_stop_strings(text_lm):
    free = text_lm.generate(TEXTS, max_new_tokens=24, temperature=0, ignore_eos=True)
    assert all(len(t) > 10 for t in free)
    stop = free[0][6:10]
    stopped = text_lm.generate(TEXTS, max_new_tokens=24, temperature=0, stop=stop, ignore_eos=True)
    assert stopped == [t[: t.find(stop)] if stop in t else t for t in free]
    again = text_lm.generate(TEXTS, max_new_tokens=24, temperature=0.8, seed=5)
    assert again == text_lm.generate(TEXTS, max_new_tokens=24, temperature=0.8, seed=5)
    assert "".join(text_lm.stream(TEXTS[0], max_new_tokens=24, temperature=0, ignore_eos=True)) == free[0]


@pytest.mark.slow
def test_sample_command_streams_and_reads_prompts_from_stdin(
    text_lm, hf_tiny_gpt2_vocab, gpt2_bpe_file, capsys, monkeypatch
):
    expected = text_lm.generate(TEXTS, max_new_tokens=24, temperature=0)
    args = ["sample", str(hf_tiny_gpt2_vocab.path), "--tokenizer", gpt2_bpe_file, "--temperature", "0"]
    args += ["--max-new-tokens", "24"]
    assert cli.main([*args, "--prompt", TEXTS[0]]) == 0
    assert capsys.readouterr().out == TEXTS[0] + expected[0] + "\n"
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(TEXTS) + "\n"))
    assert cli.main(args) == 0
    assert capsys.readouterr().out == "".join(e + "\n" for e in expected)
    assert cli.main([*args, "--top-p", "2"]) == 1
    assert "top_p" in capsys.readouterr().err


def test_a_chunk_or_batch_that_cannot_make_progress_is_refused(text_lm):
    params = text_lm.sampling(max_new_tokens=4, temperature=0)
    for call in (
        lambda: text_lm.generate_tokens([[1, 2, 3]], params, chunk=0),
        lambda: next(text_lm.stream(TEXTS[0], chunk=0, max_new_tokens=4)),
        lambda: text_lm.engine(max_batch=0),
        lambda: text_lm.engine(kv_tokens=0),
        lambda: text_lm.engine(page_size=0),
        lambda: text_lm.engine(max_batch=1, kv_tokens=64).start(chunk=0),
        lambda: text_lm.engine(max_batch=1, kv_tokens=64).start(max_queue=-1),
    ):
        with pytest.raises(ValueError, match=r"must be an integer >= 1"):
            call()


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.7, 5, 1.0), (1.3, 6, 0.8)],
)
def test_sampled_tokens_follow_the_filtered_softmax(temperature, top_k, top_p):
    """Chi-square over 20,000 seeded draws from an 8-token vocabulary against the distribution computed
    here in numpy: softmax(logits / T), cut to the top k, then to the smallest set reaching p."""
    from scipy import stats

    logits = np.array([2.0, 1.5, 1.2, 0.9, 0.3, 0.0, -0.4, -1.0], np.float32)
    scaled = logits.astype(np.float64) / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    kept = order[: top_k or len(order)]
    p_kept = probs[kept] / probs[kept].sum()
    reach = np.searchsorted(np.cumsum(p_kept), top_p - 1e-7) + 1 if top_p < 1 else len(kept)
    expected = np.zeros_like(probs)
    expected[kept[:reach]] = probs[kept[:reach]] / probs[kept[:reach]].sum()

    n = 20_000
    batch = jnp.broadcast_to(jnp.asarray(logits), (n, logits.size))
    filtered = gen.filter_logits(
        batch, jnp.full(n, temperature), jnp.full(n, top_k, jnp.int32), jnp.full(n, top_p, jnp.float32)
    )
    draws = np.asarray(gen.sample(filtered, jax.random.split(jax.random.key(0), n)))
    counts = np.bincount(draws, minlength=logits.size)
    support = expected > 0
    assert counts[~support].sum() == 0  # nothing outside what top-k and top-p keep
    if support.sum() > 1:
        chi2, p_value = stats.chisquare(counts[support], n * expected[support])
        assert p_value > 1e-3, (counts, n * expected, chi2)


def inverse_cdf(probs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """numpy's one-level inverse CDF: one uniform per row against the cumulative sum."""
    cdf = np.cumsum(probs, axis=-1)
    u = rng.random(len(probs)) * cdf[:, -1]
    return np.minimum((cdf <= u[:, None]).sum(-1), probs.shape[-1] - 1)


@pytest.mark.slow
@pytest.mark.parametrize(
    "settings",
    [
        # (a case of temperature 0.6 alone was cut: a temperature other than 1 is the top_p case's 0.8, the
        # top_k_top_p_min_p case's 1.2 and the penalties case's 0.9, by the same scaling as plain's)
        dict(temperature=1.0),
        dict(temperature=1.0, top_k=20),
        dict(temperature=0.8, top_p=0.9),
        dict(temperature=1.2, top_k=30, top_p=0.8, min_p=0.02),
        dict(
            temperature=0.9,
            repetition_penalty=1.3,
            frequency_penalty=0.5,
            presence_penalty=0.4,
            logit_bias={3: 2.0, 7: -100.0},
            min_tokens=4,
            stop_token_ids=[0, 1],
        ),
    ],
    ids=["plain", "top_k", "top_p", "top_k_top_p_min_p", "penalties_bias_min_tokens"],
)
def test_draws_match_numpys_inverse_cdf_sampler(settings):
    """Two-sample chi-square over 20,000 seeded rows of a 64-token vocabulary: the draws of `choose` against
    numpy's inverse-CDF draws from the penalised and filtered distribution `choose` computes. Tokens the
    filters or the ban remove are never drawn. (Several of the draw's blocks: the test below.)"""
    from scipy import stats

    n, V = N_ROWS, 64
    rng = np.random.default_rng(5)
    logits = jnp.broadcast_to(jnp.asarray(rng.normal(0, 2, V).astype(np.float32)), (n, V))
    seen = jnp.broadcast_to(jnp.arange(V) % 5 == 0, (n, V))
    counts = jnp.broadcast_to(jnp.asarray(rng.integers(0, 3, V), jnp.int32), (n, V))
    count = jnp.full(n, 2, jnp.int32)
    s = jax.tree.map(jnp.asarray, settings_for([SamplingParams(**settings, seed=i) for i in range(n)], n))
    token, *_ = gen.choose(logits, seen, count, s, V, counts=counts)
    one = jax.tree.map(lambda a: a[:1], s)
    probs = np.asarray(gen.distribution(gen.penalize(logits[:1], seen[:1], counts[:1], count[:1], one), one))[0]
    drawn = np.bincount(np.asarray(token), minlength=V)
    before = np.bincount(inverse_cdf(np.broadcast_to(probs, (n, V)), rng), minlength=V)
    assert drawn[probs == 0].sum() == 0
    common = n * probs >= 5  # tokens expected at least 5 times; the rare ones pooled into one bin
    assert common.sum() > 3  # a real choice
    rare = ~common & (probs > 0)
    table = [np.append(c[common], c[rare].sum()) if rare.any() else c[common] for c in (drawn, before)]
    _, p_value, *_ = stats.chi2_contingency(table)
    assert p_value > 1e-3, (drawn, before)


@pytest.mark.parametrize("V", [1000, 3 * gen.DRAW_BLOCK])  # a last block part full; whole blocks
def test_a_draw_over_several_blocks_follows_the_weights_and_never_takes_a_zero(V):
    """`draw`'s two levels (a block by the blocks' sums, then a token of it) over a vocabulary of several
    blocks: chi-square goodness of fit of 20,000 seeded rows against uneven weights, and the tokens of
    weight 0 (the vocabulary's first and last, a whole block, and the tokens beside it in the blocks either
    side) never drawn."""
    from scipy import stats

    n, block = N_ROWS, gen.DRAW_BLOCK
    weights = np.random.default_rng(11).exponential(1.0, V) ** 3
    zero = np.zeros(V, bool)
    zero[[0, V - 1, block - 1, 2 * block]] = True
    zero[block : 2 * block] = True
    weights[zero] = 0.0
    keys = jax.vmap(jax.random.key)(jnp.arange(n))
    tokens = np.asarray(gen.draw(jnp.broadcast_to(jnp.asarray(weights, jnp.float32), (n, V)), keys))
    counts = np.bincount(tokens, minlength=V)
    assert counts.size == V and counts[zero].sum() == 0
    expected = n * weights / weights.sum()
    common = expected >= 5  # the rare tokens pooled into one bin
    rare = ~common & ~zero
    assert common.sum() > 20 and {t // block for t in np.flatnonzero(common)} >= {0, 2}  # blocks both sides
    observed, wanted = (np.append(c[common], c[rare].sum()) for c in (counts, expected))
    _, p_value = stats.chisquare(observed, wanted)
    assert p_value > 1e-3, (observed, wanted)


def test_a_draw_takes_no_zero_weight_at_either_end_and_a_row_without_weight_draws_past_the_vocabulary():
    """The edges a statistical test cannot reach (u of 2^-24 and of 1): the first and the last token of
    positive weight, never the zeros around them. A row of NaN weights or none above 0 (a diverged
    adapter's logits) draws V, an id past the vocabulary, which the scheduler fails as it fails a greedy
    row's (tests/test_faults_live.py)."""
    weights = jnp.asarray([[0.0, 0.0, 1.0, 0.0, 2.0, 0.0, 0.0]] * 2)
    assert np.asarray(gen._first_reaching(weights, jnp.asarray([2.0**-24, 1.0]))).tolist() == [2, 4]
    rows = jnp.asarray([[np.nan] * 7, [0.0] * 7, [0.0] * 5 + [3.0, 0.0]])
    keys = jax.vmap(jax.random.key)(jnp.arange(3))
    assert np.asarray(gen.draw(rows, keys)).tolist() == [7, 7, 5]
    assert np.asarray(gen.sample(jnp.full((1, 600), np.nan), keys[:1])).tolist() == [600]


LOGITS = np.array([2.0, 1.5, 1.2, 0.9, 0.3, 0.0, -0.4, -1.0], np.float32)  # the target of the chi-square tests
N_ROWS = 20_000


def choose_for_rows(
    proposal: np.ndarray, draft_probs: np.ndarray | None = None, temperature: float = 1.0, logits: np.ndarray = LOGITS
) -> np.ndarray:
    """`choose` for N_ROWS rows of `logits` at `temperature`, each with its own seed and proposal."""
    n, V = N_ROWS, logits.size
    settings = settings_for([SamplingParams(temperature=temperature, seed=s) for s in range(n)], n)
    q = None if draft_probs is None else jnp.broadcast_to(jnp.asarray(draft_probs, jnp.float32), (n, V))
    token, *_ = gen.choose(
        jnp.broadcast_to(jnp.asarray(logits), (n, V)),
        jnp.zeros((n, V), bool),
        jnp.zeros(n, jnp.int32),
        jax.tree.map(jnp.asarray, settings),
        V,
        proposal=jnp.asarray(proposal, jnp.int32),
        draft_probs=q,
    )
    return np.asarray(token)


@pytest.mark.parametrize("offered", [0, 3, 7])  # the likeliest token, a middling one, the least likely
def test_a_speculated_token_leaves_the_distribution_unchanged(offered):
    """Chi-square over 20,000 seeded rows that each get the same proposal: keeping it with probability
    p(d) and otherwise drawing from p without d gives tokens distributed as p (Leviathan et al.). The
    counts also reject the nearby wrong rule that redraws from p itself after a rejection."""
    from scipy import stats

    p = np.exp(LOGITS.astype(np.float64) - LOGITS.max())
    p /= p.sum()
    n = N_ROWS
    counts = np.bincount(choose_for_rows(np.full(n, offered)), minlength=8)
    _, p_value = stats.chisquare(counts, n * p)
    assert p_value > 1e-3, (counts, n * p)
    redraw = p[offered] * np.eye(8)[offered] + (1 - p[offered]) * p  # accept, else draw from p again
    _, p_wrong = stats.chisquare(counts, n * redraw)
    assert p_wrong < 1e-6, (counts, n * redraw)


def test_greedy_rows_keep_a_proposal_only_when_it_is_their_argmax():
    """Rows offered the argmax (token 3), another token and none: each greedy row gives the argmax. (The rows and
    shapes of the chi-square tests above, whose operations are compiled already; LOGITS rolled so that the argmax is
    not token 0, which a dropped or clipped proposal would give.)"""
    logits = np.roll(LOGITS, 3)
    token = choose_for_rows(np.resize([3, 0, -1], N_ROWS), temperature=0.0, logits=logits)
    assert (
        int(np.argmax(logits)) == 3
        and np.bincount(token, minlength=logits.size).tolist() == [0] * 3 + [N_ROWS] + [0] * 4
    )


def test_a_draft_models_proposals_leave_the_distribution_unchanged():
    """Chi-square over 20,000 seeded rows whose proposals are drawn from a draft distribution q far
    from the target's p: keeping d with probability min(1, p(d)/q(d)) and otherwise drawing from
    max(p - q, 0) gives tokens distributed as p, and keeps sum(min(p, q)) of the proposals. The counts
    reject redrawing from p itself after a rejection."""
    from scipy import stats

    p = np.exp(LOGITS.astype(np.float64) - LOGITS.max())
    p /= p.sum()
    q = np.exp(-0.5 * LOGITS.astype(np.float64))  # prefers what p does not
    q /= q.sum()
    n = N_ROWS
    proposals = np.random.default_rng(0).choice(8, size=n, p=q)
    token = choose_for_rows(proposals, q)
    counts = np.bincount(token, minlength=8)
    _, p_value = stats.chisquare(counts, n * p)
    assert p_value > 1e-3, (counts, n * p)
    redraw = np.minimum(p, q) + (1 - np.minimum(p, q).sum()) * p  # the near miss: draw from p after a rejection
    _, p_wrong = stats.chisquare(counts, n * redraw)
    assert p_wrong < 1e-6, (counts, n * redraw)
    # A rejection never draws d again (max(p - q, 0) is 0 there), so the kept share is the acceptance rate:
    # sum(min(p, q)), not the sum(p * q) of the point-mass rule, which is also exact but keeps less.
    kept = int((token == proposals).sum())
    assert stats.binomtest(kept, n, np.minimum(p, q).sum()).pvalue > 1e-3
    assert stats.binomtest(kept, n, (p * q).sum()).pvalue < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["gpu", "tpu"])
@pytest.mark.parametrize("mesh", [None, "data=2,fsdp=2,model=2"])
def test_the_paged_kernels_equal_the_gather_path(kernel, mesh):
    """Both Pallas paged-attention kernels (interpreted here: the GPU one by Pallas, the TPU one in TPU
    interpret mode) give the attention of one query per row over pages scattered in the pool, to the
    first `lengths` tokens, alone and per shard of a mesh. The GPU kernel on a float32 pool; the TPU kernel
    on a bfloat16 one, the float pool the resolver gives it (its int8 pool: tests/test_kv_int8.py)."""
    from jax.experimental.pallas import tpu as pltpu

    from meshlm.paged_attention import paged_attention
    from meshlm.sharding import make_mesh

    B, H, K, pages, size = 4, 4, 128, 12, 16
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (B, H, K)) / np.sqrt(K)
    dtype = jnp.bfloat16 if kernel == "tpu" else jnp.float32
    k, v = (jax.random.normal(key, (H, pages, size, K)).astype(dtype) for key in keys[1:])
    table = jnp.asarray(np.random.default_rng(0).permutation(np.arange(1, pages))[: B * 2].reshape(B, 2), jnp.int32)
    lengths = jnp.asarray([1, 16, 17, 32], jnp.int32)
    gathered = [jnp.moveaxis(x[:, table].reshape(H, B, 2 * size, K), 0, 2).astype(jnp.float32) for x in (k, v)]
    scores = jnp.einsum("bhk,bshk->bhs", q, gathered[0])
    scores = jnp.where(jnp.arange(2 * size) < lengths[:, None, None], scores, -jnp.inf)
    expected = jnp.einsum("bhs,bshk->bhk", jax.nn.softmax(scores, -1), gathered[1])
    attend = jax.jit(lambda *args: paged_attention(*args, kernel=kernel))
    with pltpu.force_tpu_interpret_mode() if kernel == "tpu" else contextlib.nullcontext():
        if mesh is None:
            got = attend(q, k, v, table, lengths)
        else:
            with jax.set_mesh(make_mesh(mesh)):
                got = attend(q, k, v, table, lengths)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected), atol=2e-5, rtol=0)
