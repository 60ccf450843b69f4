"""The OpenAI / vLLM sampling parameters: presence and frequency penalties, logit_bias, min_p, min_tokens,
include_stop_str_in_output and ignore_eos. The filters against transformers' logits processors and OpenAI's
published penalty formula (computed here in numpy), greedy generation against transformers' generate with
the same processors, seeded draws by chi-square against the expected distribution, and the text options on
a model with the real GPT-2 tokenizer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from scipy import stats
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import meshlm
from meshlm.api import GENERATE_BATCH
from meshlm.config import InputError
from meshlm.serve import sampler as gen
from meshlm.serve.batch import settings_for
from meshlm.serve.params import MAX_LOGIT_BIAS, SamplingParams

NEW = 24  # tokens generated in the comparisons with transformers


@pytest.fixture(scope="module")
def lm(hf_tiny):
    return meshlm.load(hf_tiny.path)


@pytest.fixture(scope="module")
def text_lm(hf_tiny_gpt2_vocab, gpt2_bpe_file):
    return meshlm.load(hf_tiny_gpt2_vocab.path, tokenizer=gpt2_bpe_file)


# ---------------------------------------------------------------------------------------------------
# The references


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's formula as a transformers processor: logit[j] -= frequency * c[j] + presence * (c[j] > 0),
    c counting the tokens generated after the prompt."""

    def __init__(self, prompt_len: int, frequency: float, presence: float):
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        c = np.stack([np.bincount(row[self.prompt_len :].numpy(), minlength=scores.shape[-1]) for row in input_ids])
        return scores - torch.as_tensor(self.frequency * c + self.presence * (c > 0), dtype=scores.dtype)


def openai_penalties(logits: np.ndarray, counts: np.ndarray, frequency: float, presence: float) -> np.ndarray:
    return logits - frequency * counts - presence * (counts > 0)


def hf_generate(
    hf,
    prompt: list[int],
    new: int = NEW,
    *,
    stop: int | None = None,
    min_tokens: int = 0,
    bias: dict[int, float] | None = None,
    repetition: float = 1.0,
    frequency: float = 0.0,
    presence: float = 0.0,
) -> tuple[list[int], bool]:
    """transformers' greedy generate with the same settings: `sequence_bias` (applied first), the repetition
    penalty, `min_new_tokens`, then OpenAI's penalties (custom processors come after the built-in ones).
    The new tokens without the stop token, and whether it stopped there."""
    processors = LogitsProcessorList(
        [OpenAIPenalties(len(prompt), frequency, presence)] if frequency or presence else []
    )
    with torch.no_grad():
        out = hf.torch_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=new,
            min_new_tokens=min_tokens or None,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=stop,
            sequence_bias={(t,): b for t, b in bias.items()} if bias else None,
            repetition_penalty=repetition,
            logits_processor=processors,
        )
    tokens = out[0, len(prompt) :].tolist()
    stopped = stop is not None and tokens[-1:] == [stop]
    return tokens[:-1] if stopped else tokens, stopped


def hf_warpers(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """transformers' sampling warpers in its generate's order: temperature, top-k, top-p, min-p."""
    x = torch.as_tensor(logits[None].astype(np.float32))
    warpers = [TemperatureLogitsWarper(temperature)]
    warpers += [TopKLogitsWarper(top_k)] if top_k else []
    warpers += [TopPLogitsWarper(top_p)] if top_p < 1 else []
    warpers += [MinPLogitsWarper(min_p)] if min_p else []
    for warper in warpers:
        x = warper(None, x)
    return x.numpy()[0]


def softmax(x: np.ndarray) -> np.ndarray:
    p = np.exp(x.astype(np.float64) - x.max())
    return p / p.sum()


# ---------------------------------------------------------------------------------------------------
# SamplingParams


def test_logit_bias_is_normalised_to_sorted_pairs_and_checked():
    sp = SamplingParams(logit_bias={9: 1.5, "3": -100, 5: 100.0})
    assert sp.logit_bias == ((3, -100.0), (5, 100.0), (9, 1.5))
    assert SamplingParams(logit_bias=[(9, 1.5), (3, -100)]).logit_bias == ((3, -100.0), (9, 1.5))
    assert sp.replace(max_new_tokens=3).logit_bias == sp.logit_bias and hash(sp) == hash(sp.replace())
    assert SamplingParams(logit_bias=None).logit_bias == ()
    assert len(SamplingParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS)}).logit_bias) == MAX_LOGIT_BIAS
    for bad, words in [
        ({1: 100.5}, r"\[-100, 100\]"),
        ({1: float("nan")}, r"\[-100, 100\]"),
        ({-1: 1.0}, "integers >= 0"),
        ({"x": 1.0}, "integers >= 0"),
        ({1.0: 1.0}, "integers >= 0"),
        ({1: 1.0, "1": 2.0}, "twice"),
        ({i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}, f"at most {MAX_LOGIT_BIAS}"),
        ("12", "map token ids"),
        ([1, 2], "map token ids"),
    ]:
        with pytest.raises(InputError, match=words):
            SamplingParams(logit_bias=bad)


def test_the_new_settings_are_validated_with_clear_messages():
    for bad, words in [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-2.01), "frequency_penalty"),
        (dict(frequency_penalty=float("inf")), "frequency_penalty"),
        (dict(min_p=1.5), "min_p"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=1.0), "min_tokens"),
        (dict(min_tokens=17, max_new_tokens=16), "min_tokens must be at most max_new_tokens"),
        (dict(include_stop_str_in_output=1), "include_stop_str_in_output"),
    ]:
        with pytest.raises(InputError, match=words):
            SamplingParams(**bad)
    SamplingParams(presence_penalty=-2, frequency_penalty=2, min_p=1, min_tokens=16, max_new_tokens=16)


def test_logit_bias_ids_beyond_the_vocabulary_are_refused(lm):
    with pytest.raises(InputError, match=r"logit_bias: token ids must lie in \[0, 512\)"):
        lm.generate_tokens([[1, 2, 3]], SamplingParams(max_new_tokens=2, logit_bias={3: 1.0, 512: 1.0}))


# ---------------------------------------------------------------------------------------------------
# The filters against transformers' processors and OpenAI's formula


def test_the_penalties_agree_with_transformers_processors_and_openais_formula():
    """logit_bias, repetition penalty, frequency and presence penalties and min_tokens, per row of a batch,
    against transformers' SequenceBias, RepetitionPenalty and MinNewTokensLength processors and OpenAI's
    formula over counts of the output alone (the repetition penalty sees the prompt too)."""
    rng = np.random.default_rng(0)
    B, V, prompt_len = 4, 64, 6
    logits = rng.normal(0, 3, (B, V)).astype(np.float32)
    history = rng.integers(0, 12, (B, prompt_len + 9))  # few distinct tokens: repeats in prompt and output
    history[2, prompt_len:] = history[2, :9]  # row 2's output repeats its prompt
    params = [
        SamplingParams(logit_bias={3: 5.0, 40: -100.0}, stop_token_ids=(1, 7), min_tokens=9),
        SamplingParams(repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=-0.4),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-1.0, presence_penalty=2.0, logit_bias={5: -3.5}),
        SamplingParams(
            repetition_penalty=1.5,
            frequency_penalty=2.0,
            presence_penalty=0.5,
            logit_bias={0: 100},
            stop_token_ids=(2,),
            min_tokens=10,
        ),
    ]
    settings = jax.tree.map(jnp.asarray, settings_for(params, B))
    seen = np.zeros((B, V), bool)
    counts = np.zeros((B, V), np.int32)
    for b in range(B):
        seen[b, history[b]] = True
        np.add.at(counts[b], history[b, prompt_len:], 1)
    count = jnp.full(B, history.shape[1] - prompt_len, jnp.int32)  # 9 tokens produced: row 0 may stop, row 3 not
    got = np.asarray(gen.penalize(jnp.asarray(logits), jnp.asarray(seen), jnp.asarray(counts), count, settings))

    for b, sp in enumerate(params):
        ids, x = torch.as_tensor(history[b : b + 1]), torch.as_tensor(logits[b : b + 1])
        if sp.logit_bias:
            x = SequenceBiasLogitsProcessor({(t,): v for t, v in sp.logit_bias})(ids, x)
        x = RepetitionPenaltyLogitsProcessor(sp.repetition_penalty)(ids, x)
        if sp.stop_token_ids:
            x = MinNewTokensLengthLogitsProcessor(prompt_len, sp.min_tokens, list(sp.stop_token_ids))(ids, x)
        want = openai_penalties(x.numpy()[0], counts[b], sp.frequency_penalty, sp.presence_penalty)
        np.testing.assert_allclose(got[b], want, rtol=1e-6, atol=1e-5)
    assert np.isneginf(got[3, 2]) and np.isfinite(got[0, [1, 7]]).all()  # row 0 has its 9 tokens; row 3 needs 10


def test_min_p_and_its_place_after_top_k_and_top_p_agree_with_transformers():
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 3, (6, 200)).astype(np.float32)
    cases = [
        (1.0, 0, 1.0, 0.05),
        (1.0, 0, 1.0, 0.5),
        (0.7, 0, 1.0, 0.2),
        (1.5, 20, 1.0, 0.1),
        (1.2, 0, 0.6, 0.3),
        (0.8, 30, 0.9, 1.0),
    ]
    t, k, p, m = (jnp.asarray(np.array(c)) for c in zip(*cases, strict=True))
    got = np.asarray(
        gen.filter_logits(
            jnp.asarray(logits),
            t.astype(jnp.float32),
            k.astype(jnp.int32),
            p.astype(jnp.float32),
            m.astype(jnp.float32),
        )
    )
    only = np.asarray(gen.min_p_filter(jnp.asarray(logits), m.astype(jnp.float32)))
    for i, (temperature, top_k, top_p, min_p) in enumerate(cases):
        want = hf_warpers(logits[i], temperature, top_k, top_p, min_p)
        np.testing.assert_array_equal(np.isfinite(got[i]), np.isfinite(want))
        np.testing.assert_allclose(got[i][np.isfinite(got[i])], want[np.isfinite(want)], rtol=1e-6)
        alone = MinPLogitsWarper(min_p)(None, torch.as_tensor(logits[i : i + 1])).numpy()[0]
        np.testing.assert_array_equal(np.isfinite(only[i]), np.isfinite(alone))
    assert np.isfinite(got[5]).sum() == 1  # min_p 1 keeps the likeliest token alone

    # top-p before min-p (transformers' order; vLLM's is the other way round): with p = (.3, .25, .2, .1, .05,
    # .05, .05), top-p .8 keeps four tokens and min-p .3 (>= .09) keeps them all; min-p first would leave four
    # renormalised to (.35, .29, .24, .12), of which top-p .8 keeps three
    probs = np.array([0.3, 0.25, 0.2, 0.1, 0.05, 0.05, 0.05])
    one = lambda v, dtype: jnp.asarray([v], dtype)
    kept = gen.filter_logits(
        jnp.log(jnp.asarray(probs[None], jnp.float32)),
        one(1.0, jnp.float32),
        one(0, jnp.int32),
        one(0.8, jnp.float32),
        one(0.3, jnp.float32),
    )
    assert np.isfinite(np.asarray(kept[0])).tolist() == [True] * 4 + [False] * 3
    np.testing.assert_array_equal(np.isfinite(kept[0]), np.isfinite(hf_warpers(np.log(probs), 1.0, 0, 0.8, 0.3)))


# ---------------------------------------------------------------------------------------------------
# Seeded draws: chi-square against the expected distribution

LOGITS = np.array([2.0, 1.5, 1.2, 0.9, 0.3, 0.0, -0.4, -1.0], np.float32)
N_ROWS = 20_000


@pytest.mark.parametrize(
    "settings, seen, counts, proposal",
    [
        (dict(min_p=0.3), (), (), None),
        (dict(min_p=0.25, temperature=0.7, top_k=6, top_p=0.95), (), (), None),
        (
            dict(
                temperature=1.1,
                repetition_penalty=1.2,
                frequency_penalty=0.4,
                presence_penalty=0.3,
                logit_bias={7: 2.5, 0: -1.0},
                min_p=0.05,
            ),
            (0, 5),
            (0, 0, 1, 5, 5, 5),
            None,
        ),
        (
            dict(temperature=0.9, frequency_penalty=0.5, presence_penalty=-0.3, logit_bias={6: 1.5}, min_p=0.1),
            (1,),
            (1, 1, 2),
            1,
        ),
    ],
    ids=["min_p", "min_p_after_top_k_top_p", "penalties_and_bias", "speculated_with_penalties"],
)
def test_sampled_tokens_follow_the_penalised_and_filtered_distribution(settings, seen, counts, proposal):
    """Chi-square over 20,000 seeded rows of an 8-token vocabulary against the distribution computed
    here: logit bias, repetition penalty (transformers), OpenAI's penalties over the output counts, then
    transformers' warpers and a softmax. With a proposal (speculation), the kept-or-redrawn token still
    follows that distribution."""
    n, V = N_ROWS, LOGITS.size
    sp = SamplingParams(**settings)
    c = np.bincount(np.array(counts, int), minlength=V)
    mask = np.zeros(V, bool)
    mask[list(seen) + list(counts)] = True  # the repetition penalty sees the prompt and the output
    x = LOGITS.astype(np.float32).copy()
    for t, b in sp.logit_bias:
        x[t] += b
    x = np.where(mask, np.where(x > 0, x / sp.repetition_penalty, x * sp.repetition_penalty), x)
    x = openai_penalties(x, c, sp.frequency_penalty, sp.presence_penalty)
    expected = softmax(hf_warpers(x, sp.temperature, sp.top_k, sp.top_p, sp.min_p))

    params = [sp.replace(seed=s) for s in range(n)]
    token, *_ = gen.choose(
        jnp.broadcast_to(jnp.asarray(LOGITS), (n, V)),
        jnp.broadcast_to(jnp.asarray(mask), (n, V)),
        jnp.full(n, len(counts), jnp.int32),
        jax.tree.map(jnp.asarray, settings_for(params, n)),
        V,
        proposal=None if proposal is None else jnp.full(n, proposal, jnp.int32),
        counts=jnp.broadcast_to(jnp.asarray(c, jnp.int32), (n, V)),
    )
    got = np.bincount(np.asarray(token), minlength=V)
    support = expected > 0
    assert got[~support].sum() == 0, (got, expected)
    assert support.sum() > 2  # the filters leave a real choice
    _, p_value = stats.chisquare(got[support], n * expected[support] / expected[support].sum())
    assert p_value > 1e-3, (got, n * expected)
    if counts:  # the counts tell the penalised distribution from the plain one
        plain = softmax(hf_warpers(LOGITS, sp.temperature, sp.top_k, sp.top_p, sp.min_p))
        assert (got[plain == 0] > 0).any() or stats.chisquare(got[plain > 0], n * plain[plain > 0]).pvalue < 1e-6


# ---------------------------------------------------------------------------------------------------
# Greedy generation against transformers' generate


@pytest.fixture(scope="module")
def rows(hf_tiny):
    """Five prompts and, for each, the token transformers' plain greedy generate produces first. The third
    prompt ends with its own greedy continuation, so penalties that wrongly counted the prompt would
    change what follows."""
    rng = np.random.default_rng(11)
    prompts = [rng.integers(1, 512, n).tolist() for n in (7, 12, 4, 9, 15)]
    prompts[2] += hf_generate(hf_tiny, prompts[2], 12)[0]
    return prompts, [hf_generate(hf_tiny, p, 1)[0][0] for p in prompts]


def row_settings(first: list[int]) -> list[dict]:
    """Per-row settings for one batch: plain; logit_bias banning the plain first token; frequency and
    presence penalties; min_tokens with the plain first token as the stop token (so it would stop at once); all."""
    return [
        dict(),
        dict(bias={first[1]: -100.0, 3: 2.0}),
        dict(frequency=1.6, presence=1.2),
        dict(stop=first[3], min_tokens=6),
        dict(bias={first[4]: 100.0, 9: 1.0}, repetition=1.2, frequency=1.5, presence=-0.5, stop=first[4], min_tokens=4),
    ]


def sampling_of(d: dict) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=NEW,
        temperature=0.0,
        stop_token_ids=() if d.get("stop") is None else (d["stop"],),
        min_tokens=d.get("min_tokens", 0),
        logit_bias=d.get("bias"),
        repetition_penalty=d.get("repetition", 1.0),
        frequency_penalty=d.get("frequency", 0.0),
        presence_penalty=d.get("presence", 0.0),
    )


@pytest.mark.slow
def test_greedy_rows_with_the_new_settings_match_transformers_in_one_batch(lm, hf_tiny, rows):
    """Each row of one batch has its own settings, and each equals transformers' greedy generate with the
    same processors; the rows without a setting are untouched by the others'."""
    prompts, first = rows
    settings = row_settings(first)
    got = lm.generate_tokens(prompts, [sampling_of(d) for d in settings])
    for i, (prompt, d, completion) in enumerate(zip(prompts, settings, got, strict=True)):
        tokens, stopped = hf_generate(hf_tiny, prompt, **d)
        assert completion.tokens == tokens, i
        assert completion.finish_reason == ("stop" if stopped else "length")
    assert got[0].tokens[0] == first[0] and got[1].tokens[0] != first[1]
    assert first[1] not in got[1].tokens
    assert len(got[3].tokens) >= 6 and first[3] not in got[3].tokens[:6]
    # row 4's +100 bias makes its stop token the argmax whenever allowed: it stops right at min_tokens
    assert len(got[4].tokens) == 4 and got[4].finish_reason == "stop"
    # without min_tokens, row 3 stops at once
    (alone,) = lm.generate_tokens([prompts[3]], sampling_of({**settings[3], "min_tokens": 0}))
    assert alone.tokens == [] and alone.finish_reason == "stop"


def test_logit_bias_forces_or_bans_a_token(lm, rows):
    prompts, first = rows
    # a third row without a bias: three rows decode in the batch of four that the top-alternatives test below
    # decodes too (two rows would compile a batch of two for this test alone); the others' biases leave it alone
    forced, banned, plain = lm.generate_tokens(
        prompts[:3], [sampling_of(dict(bias={77: 100.0})), sampling_of(dict(bias={first[1]: -100.0})), sampling_of({})]
    )
    assert plain.tokens[0] == first[2]
    assert forced.tokens == [77] * NEW
    assert forced.logprobs[0] < np.log(0.5)  # logprobs stay the model's own, before any bias
    assert first[1] not in banned.tokens


def test_top_alternatives_are_computed_for_the_rows_that_want_them(lm, hf_tiny, rows):
    """Rows asking for 0, 2 and 5 alternatives in one batch: the same tokens and logprobs as the same rows
    asking for all 5; each reports as many alternatives as it asked for, the likeliest first, as transformers'
    log-softmax has them. A batch where no row wants alternatives skips their top-k: the same tokens and
    logprobs again."""
    prompts = rows[0][:3]
    full = lm.generate_tokens(prompts, SamplingParams(max_new_tokens=6, temperature=0.0))
    mixed = lm.generate_tokens(
        prompts, [SamplingParams(max_new_tokens=6, temperature=0.0, logprobs=n) for n in (0, 2, 5)]
    )
    none = lm.generate_tokens(prompts, SamplingParams(max_new_tokens=6, temperature=0.0, logprobs=0))
    for n, want, got, bare in zip((0, 2, 5), full, mixed, none, strict=True):
        assert got.tokens == want.tokens == bare.tokens
        np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=0, atol=1e-6)
        np.testing.assert_allclose(bare.logprobs, want.logprobs, rtol=0, atol=1e-6)
        assert [len(t) for t in got.top_logprobs] == [n] * len(got.tokens)
        assert got.top_logprobs == [t[:n] for t in want.top_logprobs]
        assert bare.top_logprobs == [[]] * len(bare.tokens)
    with torch.no_grad():
        logits = hf_tiny.torch_model(torch.tensor([prompts[2]])).logits[0, -1].double()
    logp = torch.log_softmax(logits, -1).numpy()
    top = np.argsort(-logp)[:5]
    assert [i for i, _ in mixed[2].top_logprobs[0]] == top.tolist()
    np.testing.assert_allclose([v for _, v in mixed[2].top_logprobs[0]], logp[top], rtol=0, atol=1e-4)
    with pytest.raises(InputError, match="logprobs must be in"):
        SamplingParams(logprobs=6)


@pytest.mark.slow
@pytest.mark.parametrize("speculation", ["ngram", "draft"])
def test_speculative_decoding_applies_the_settings_to_the_target(lm, rows, speculation):
    """Prompt lookup and a draft model (the model itself) verify their proposals against the penalised
    target: greedy rows give the same tokens as plain decoding."""
    prompts, first = rows
    params = [sampling_of(d) for d in row_settings(first)]
    options = dict(ngram=2) if speculation == "ngram" else dict(draft=lm)
    engine = lm.engine(max_batch=GENERATE_BATCH, speculate=3, **options)  # the shapes of `lm.generate_tokens`
    got = engine.generate(prompts, params)
    want = lm.generate_tokens(prompts, params)
    assert [c.tokens for c in got] == [c.tokens for c in want]
    assert engine.scheduler.stats.proposed > 0


def test_a_slots_output_counts_start_again_for_its_next_row(lm, hf_tiny, rows):
    """A slot's frequency and presence penalties count its own row's output only: the next row in the
    same slot (the first free one) generates what transformers does."""
    prompts, _ = rows
    settings = dict(frequency=2.0, presence=2.0)
    for prompt in prompts[:2]:  # one after the other, in slot 0
        (got,) = lm.generate_tokens([prompt], sampling_of(settings))
        assert got.tokens == hf_generate(hf_tiny, prompt, **settings)[0]


# ---------------------------------------------------------------------------------------------------
# Text: stop strings with include_stop_str_in_output and min_tokens, and ignore_eos

TEXTS = ["Hello world, this is", "The quick brown fox"]


@pytest.mark.slow
def test_include_stop_str_in_output_keeps_the_stop_string(text_lm):
    free = text_lm.generate(TEXTS, max_new_tokens=24, temperature=0, ignore_eos=True)
    stop = free[0][6:10]
    kept = text_lm.generate(
        TEXTS, max_new_tokens=24, temperature=0, stop=stop, ignore_eos=True, include_stop_str_in_output=True
    )
    assert kept == [t[: t.find(stop) + len(stop)] if stop in t else t for t in free]
    assert kept[0].endswith(stop)
    streamed = "".join(
        text_lm.stream(
            TEXTS[0], max_new_tokens=24, temperature=0, stop=stop, ignore_eos=True, include_stop_str_in_output=True
        )
    )
    assert streamed == kept[0]


def test_stop_strings_apply_from_min_tokens_on(text_lm):
    """As vLLM: a stop string counts only when it ends in the text of the min_tokens-th token or a later
    one; min_tokens 0 cuts at the first occurrence."""
    sp = text_lm.sampling(max_new_tokens=24, temperature=0, ignore_eos=True)
    (free,) = text_lm.generate_tokens([text_lm.encode_prompt(TEXTS[1])], sp)
    decode = text_lm.tokenizer.decode
    stop = free.text.lstrip()[:2]  # at the start
    assert len(stop) == 2
    for min_tokens in (0, 3, 8):
        floor = len(decode(free.tokens[: max(min_tokens - 1, 0)]))
        at = free.text.find(stop, max(0, floor - len(stop) + 1))
        want = free.text if at < 0 else free.text[:at]
        (got,) = text_lm.generate_tokens(
            [text_lm.encode_prompt(TEXTS[1])], sp.replace(stop=(stop,), min_tokens=min_tokens)
        )
        assert got.text == want, min_tokens
        assert got.finish_reason == ("length" if at < 0 else "stop")
        assert got.stop_reason == (None if at < 0 else stop)  # vLLM's: the stop string that ended it


def test_ignore_eos_generates_past_the_end_of_text_token(text_lm):
    eos = text_lm.tokenizer.eot_id
    prompt = [text_lm.encode_prompt(TEXTS[0])]
    to_eos = dict(max_new_tokens=6, temperature=0, logit_bias={eos: 100})  # <|endoftext|> is the argmax
    (ended,) = text_lm.generate_tokens(prompt, text_lm.sampling(**to_eos))
    assert ended.tokens == [] and (ended.finish_reason, ended.stop_reason) == ("stop", eos)
    (ignored,) = text_lm.generate_tokens(prompt, text_lm.sampling(**to_eos, ignore_eos=True))
    assert ignored.tokens == [eos] * 6 and (ignored.finish_reason, ignored.stop_reason) == ("length", None)
    (held,) = text_lm.generate_tokens(prompt, text_lm.sampling(**to_eos, min_tokens=3))
    assert len(held.tokens) == 3 and eos not in held.tokens and held.finish_reason == "stop"
    # vLLM's one rule: stop_token_ids add to the EOS ids; ignore_eos drops the EOS ids, not the ids given
    assert text_lm.sampling(stop_token_ids=[7]).stop_token_ids == (*text_lm.eos_ids, 7)
    assert text_lm.sampling(ignore_eos=True, stop_token_ids=[7]).stop_token_ids == (7,)
    assert text_lm.sampling(ignore_eos=True).stop_token_ids == ()
    assert text_lm.sampling(ignore_eos=True, stop_token_ids=[eos]).stop_token_ids == (eos,)
    assert text_lm.generate(TEXTS[0], **to_eos, ignore_eos=True) == ["<|endoftext|>" * 6]


def test_a_model_whose_vocabulary_stops_short_of_the_end_of_text_generates_by_default(lm):
    """hf_tiny's 512 tokens stop short of the GPT-2 tokenizer's <|endoftext|> (50256): no row could sample it,
    so it is no end id, and a request with the default settings is served (it was refused as an id out of
    the vocabulary, which failed every request to such a server)."""
    assert lm.tokenizer.eot_id >= lm.config.n_vocab_used and lm.eos_ids == ()
    (done,) = lm.generate_tokens([[5, 6, 7]], lm.sampling(4, temperature=0))
    assert len(done.tokens) == 4 and done.finish_reason == "length"


def test_the_settings_are_samplingparams_fields_by_name(text_lm, monkeypatch):
    """`sampling` and `generate` take SamplingParams' fields by name, every one of them; another name is
    refused in one line that says where the names come from."""
    for call in (lambda: text_lm.sampling(temp=0.5), lambda: text_lm.generate(TEXTS, temp=0.5)):
        with pytest.raises(InputError, match=r"^unknown sampling setting 'temp': the settings are SamplingParams'"):
            call()
    asked = []
    monkeypatch.setattr(text_lm, "generate_tokens", lambda prompts, params, **_: asked.extend(params) or [])
    text_lm.generate(TEXTS, 4, seed=3, min_p=0.1, logprobs=0, stop="\n", ignore_eos=True)
    assert [(p.max_new_tokens, p.seed, p.min_p, p.logprobs, p.stop, p.stop_token_ids) for p in asked] == [
        (4, 3, 0.1, 0, ("\n",), ()),
        (4, 4, 0.1, 0, ("\n",), ()),
    ]
