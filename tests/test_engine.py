"""The generation engine: continuous batching over the paged KV cache against transformers' greedy
generate (rows joining mid-flight, with and without prefix caching), the page pool's bookkeeping, and
pages coming back after cancellation and failures."""

import gc
import weakref

import jax
import numpy as np
import pytest

import meshlm
from meshlm.serve import batch, runner
from meshlm.serve.pages import PagePool, pages_for
from meshlm.serve.scheduler import lookup
from tests.helpers.generation import greedy, hf_greedy

PAGE = 4  # small pages, so short prompts span several and share some
# Engines of one configuration share their compiled programs (the runner's steps are jitted functions, so an
# engine of shapes compiled before compiles nothing), and compiling is most of this file's time: the tests whose
# pool size proves nothing take one pool for their max_batch, TWO_ROWS_KV tokens for 2 rows and FOUR_ROWS_KV for 4,
# and the one-row tests the warm-up test's shapes (ONE_ROW, NARROW), whose programs it compiles.
TWO_ROWS_KV = 160
FOUR_ROWS_KV = 256
ONE_ROW = dict(max_batch=1, page_size=PAGE, kv_tokens=96, max_len=48)
NARROW = 4 * PAGE  # MIN_DECODE_TOKENS of the one-row tests: narrow and whole tables at this small context


@pytest.fixture(scope="module")
def lm(hf_tiny):
    return meshlm.load(hf_tiny.path)


@pytest.fixture(scope="module")
def shared_prompts():
    """Six prompts: four open with the same 13 tokens (three full pages), two are unrelated."""
    rng = np.random.default_rng(5)
    opening = rng.integers(1, 512, 13).tolist()
    tails = [rng.integers(1, 512, n).tolist() for n in (1, 6, 9, 2)]
    return [opening + t for t in tails] + [rng.integers(1, 512, n).tolist() for n in (5, 21)]


@pytest.mark.slow
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_rows_joining_mid_flight_decode_as_transformers_does(lm, hf_tiny, shared_prompts, prefix_caching):
    """Two slots for six prompts of different lengths and budgets: rows wait, join as others leave, and
    (with prefix caching) reuse the opening pages another row wrote; each row equals transformers."""
    engine = lm.engine(max_batch=2, page_size=PAGE, kv_tokens=TWO_ROWS_KV, prefix_caching=prefix_caching)
    budgets = [12, 5, 20, 9, 16, 7]
    got = engine.generate(shared_prompts, [greedy(n) for n in budgets], chunk=3)
    for prompt, n, completion in zip(shared_prompts, budgets, got, strict=True):
        assert completion.tokens == hf_greedy(hf_tiny, prompt, n)[0]
    if prefix_caching:
        # the first row writes the opening's pages; the second waits one prefill for them (an unrelated row
        # takes its place in the first), and it and the two that join later each find them
        assert engine.scheduler.pool.hits == 3 * 3 * PAGE
    else:
        assert engine.scheduler.pool.hits == 0
    assert engine.scheduler.pool.used == 0 and not engine.has_work()


@pytest.mark.slow
def test_rows_queued_together_compute_their_shared_opening_once(lm, hf_tiny, shared_prompts):
    """Four rows open with the same three pages (a multiple-choice task's continuations): the first writes
    them, the other three wait one prefill and find them cached; each row still equals transformers."""
    engine = lm.engine(max_batch=4, page_size=PAGE, kv_tokens=FOUR_ROWS_KV)
    got = engine.generate(shared_prompts[:4], [greedy(3)] * 4)
    assert engine.snapshot().prefill_calls == 2 and engine.scheduler.pool.hits == 3 * 3 * PAGE
    for prompt, completion in zip(shared_prompts[:4], got, strict=True):
        assert completion.tokens == hf_greedy(hf_tiny, prompt, 3)[0]


@pytest.mark.slow
def test_prefills_are_grouped_by_length_and_read_only_the_pages_they_need(lm, hf_tiny, monkeypatch):
    """Four short prompts and a long one admitted together run as two prefill calls: the short ones padded
    to their own bucket and attending over a narrow table, the long one alone; each row equals transformers."""
    monkeypatch.setattr(batch, "MIN_DECODE_TOKENS", 4 * PAGE)  # narrow tables exist at this small context
    engine = lm.engine(max_batch=8, page_size=PAGE, kv_tokens=512, max_len=128)
    prefills = []
    run = engine.runner.run

    def recording(batch):
        if isinstance(batch, runner.Prefill):
            prefills.append((int((batch.slots < engine.runner.max_batch).sum()), *batch.table.shape))
        return run(batch)

    monkeypatch.setattr(engine.runner, "run", recording)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, 512, n).tolist() for n in (9, 100, 3, 7, 5)]
    got = engine.generate(prompts, [greedy(6)] * 5)
    assert prefills == [(4, 4, 4), (1, 1, 128 // PAGE)]  # (rows, padded rows, table width)
    for prompt, completion in zip(prompts, got, strict=True):
        assert completion.tokens == hf_greedy(hf_tiny, prompt, 6)[0]


@pytest.mark.parametrize("mixed_steps", [False, True])
def test_a_long_prompt_is_prefilled_a_chunk_a_step_while_the_running_row_decodes(lm, hf_tiny, mixed_steps):
    """prefill_tokens 16 over pages of 4: a 41-token prompt arriving while a row decodes runs in chunks of 16, 16 and 9
    tokens over three steps, and the running row decodes its 2 tokens in each of them; the long row's first token
    comes with its last chunk. Its chunks' pages are offered to the prefix cache as they are written: a prompt
    sharing its first 32 tokens, queued with it, waits for the budget and is admitted beside the last chunk, finding
    those 32 tokens cached before the long row's prompt is whole. Every row equals transformers.

    With mixed steps the first two steps run their chunk in one pass with the running row's first token (its second
    comes from the decode call after); the last step's prefill of two rows runs alone, as one-row calls alone mix.
    Nothing changes in what the rows produce, and a warmed-up engine compiles nothing for the mixed steps."""
    engine = lm.engine(max_batch=4, page_size=PAGE, kv_tokens=FOUR_ROWS_KV, prefill_tokens=16, mixed_steps=mixed_steps)
    if mixed_steps:
        engine.warm_up()
    mixed = []
    run_mixed = engine.runner.run_mixed
    engine.runner.run_mixed = lambda prefill, decode: mixed.append(len(mixed)) or run_mixed(prefill, decode)
    rng = np.random.default_rng(7)
    short, long = rng.integers(1, 512, 5).tolist(), rng.integers(1, 512, 41).tolist()
    sharing = [*long[:32], 3, 5, 7]
    a = engine.add_request(short, greedy(24))
    engine.step(2)  # its prefill's token and 2 more
    b, c = engine.add_requests([long, sharing], [greedy(6), greedy(4)])
    seen = []
    for _ in range(3):
        engine.step(2)
        seen.append((len(a.output.tokens), b.length, len(b.output.tokens), len(c.output.tokens)))
    assert seen == [(5, 16, 0, 0), (7, 32, 0, 0), (9, 41 + 2, 3, 3)]
    assert len(mixed) == (2 if mixed_steps else 0)
    assert engine.scheduler.pool.hits == 32
    while engine.has_work():
        engine.step(2)
    for prompt, n, r in ((short, 24, a), (long, 6, b), (sharing, 4, c)):
        assert r.output.tokens == hf_greedy(hf_tiny, prompt, n)[0]
    assert engine.runner.compiles_since_warm_up == 0 or not mixed_steps


def test_each_one_row_prefill_of_a_step_mixes_with_one_of_its_decode_tokens(lm, hf_tiny):
    """Mixed steps: two prompts of different buckets arriving together run as two one-row prefill calls, and each runs
    in one pass with one of the decoding row's tokens (two of the step's three); every row equals transformers."""
    engine = lm.engine(max_batch=4, page_size=PAGE, kv_tokens=FOUR_ROWS_KV, prefill_tokens=64, mixed_steps=True)
    rng = np.random.default_rng(8)
    prompts = [rng.integers(1, 512, n).tolist() for n in (6, 5, 50)]
    mixed = []
    run_mixed = engine.runner.run_mixed
    engine.runner.run_mixed = lambda prefill, decode: mixed.append(prefill.tokens.shape) or run_mixed(prefill, decode)
    a = engine.add_request(prompts[0], greedy(12))
    engine.step(3)
    rows = engine.add_requests(prompts[1:], [greedy(5)] * 2)
    engine.step(3)
    assert sorted(mixed) == [(1, 16), (1, 64)] and len(a.output.tokens) == 1 + 3 + 3
    while engine.has_work():
        engine.step(3)
    for prompt, n, r in zip(prompts, (12, 5, 5), (a, *rows), strict=True):
        assert r.output.tokens == hf_greedy(hf_tiny, prompt, n)[0]


def test_max_batch_rows_run_at_once_not_the_compiled_batch_it_rounds_to(lm):
    """max_batch 3 compiles batches of 4 (a power of two) but runs 3 rows at once, with a pool for 3: a fourth
    waits, as the plan (`meshlm plan --serve`) counts it, and runs once a row finishes."""
    engine = lm.engine(max_batch=3, max_len=16, page_size=PAGE, prefix_caching=False)
    prompts = [[7 + i] * 6 for i in range(4)]
    steps = [[len(o.tokens) for o in outputs] for outputs in engine.run(prompts, [greedy(4)] * 4, chunk=2)]
    assert steps[0] == [3, 3, 3, 0] and steps[-1] == [4, 4, 4, 4]
    assert engine.snapshot().max_batch == 3 and engine.snapshot().kv_pages == 3 * pages_for(16, PAGE)


def test_the_default_pool_holds_max_batch_rows_of_max_len_in_whole_pages(lm):
    """max_len 10 over pages of 4 is 3 pages a row, not 2.5: every row of max_batch runs at once (the default pool
    of max_batch x max_len tokens, 10 pages, held 3 such rows, and the fourth waited for them to finish)."""
    engine = lm.engine(max_batch=4, max_len=10, page_size=PAGE, prefix_caching=False)
    prompts = [[7 + i] * 6 for i in range(4)]
    first = next(iter(engine.run(prompts, [greedy(4)] * 4, chunk=2)))
    assert [len(o.tokens) for o in first] == [3, 3, 3, 3]  # each row's prefill and a chunk of 2, in the first step
    assert engine.snapshot().kv_pages == 4 * pages_for(10, PAGE)


@pytest.mark.slow
def test_a_row_holds_pages_only_for_its_tokens(lm):
    engine = lm.engine(max_batch=4, page_size=PAGE, kv_tokens=FOUR_ROWS_KV)
    prompts = [[7 + i] * n for i, n in enumerate((3, 10, 17))]  # nothing shared: all three in one prefill
    budgets = sum(pages_for(len(p) + 30, PAGE) for p in prompts)
    for step, _ in enumerate(engine.run(prompts, [greedy(30)] * 3, chunk=2)):
        assert engine.scheduler.pool.used == sum(len(r.pages) for r in engine.scheduler.running)
        for r in engine.scheduler.running:  # pages for the tokens it has (its last chunk's included), not its budget
            assert len(r.pages) == pages_for(r.length, PAGE)
        if step == 0:
            assert engine.scheduler.pool.used == sum(pages_for(n + 2, PAGE) for n in (3, 10, 17)) < budgets / 2
    assert engine.scheduler.pool.used == 0


@pytest.mark.slow
def test_pages_come_back_after_a_cancelled_stream_and_a_failed_step(lm, hf_tiny, monkeypatch):
    engine = lm.engine(max_batch=2, page_size=PAGE, kv_tokens=TWO_ROWS_KV)
    stream = engine.run([[1, 2, 3, 4, 5]], [greedy(40)], chunk=2)
    next(stream), next(stream)
    assert engine.scheduler.pool.used > 0
    stream.close()  # the consumer stopped reading
    assert engine.scheduler.pool.used == 0 and not engine.has_work()

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    cached = list(range(7, 7 + 2 * PAGE + 3))  # its two full pages go into the prefix cache
    engine.generate([cached], [greedy(2)])
    monkeypatch.setattr(runner, "_decode", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.generate([[1, 2, 3]] * 3, [greedy(10)] * 3)
    assert engine.scheduler.pool.used == 0 and not engine.has_work()
    monkeypatch.undo()
    # the references are transformers' (not `lm.generate_tokens`, whose engine of 32 rows would compile for this
    # alone): the engine still works, from a fresh pool
    (after,) = engine.generate([[1, 2, 3]], [greedy(10)])
    assert after.tokens == hf_greedy(hf_tiny, [1, 2, 3], 10)[0]
    (again,) = engine.generate([cached], [greedy(10)])  # the fresh pool holds no cached prefix
    assert again.tokens == hf_greedy(hf_tiny, cached, 10)[0]


def test_requests_that_can_never_run_are_refused_in_one_line(lm, monkeypatch):
    engine = lm.engine(max_batch=2, page_size=PAGE, kv_tokens=32, max_len=64)
    for prompt, new, words in [
        ([1] * 70, 1, "more than the context of 64"),
        ([1] * 40, 30, "exceeds the context of 64"),
        ([1] * 20, 20, "needs more KV cache"),
        ([], 4, "at least one token"),
    ]:
        with pytest.raises(ValueError, match=words):
            engine.generate([prompt], [greedy(new)])
    with pytest.raises(ValueError, match="max_len"):
        lm.engine(max_len=10_000)
    # a step's prompt budget below a page is refused before the pool is allocated for it
    monkeypatch.setattr(runner.Runner, "reset", lambda self: pytest.fail("the pool was allocated"))
    with pytest.raises(ValueError, match=rf"prefill_tokens \(3\) must hold a KV page \({PAGE} tokens\)"):
        lm.engine(page_size=PAGE, prefill_tokens=3)


def test_the_page_pool_shares_prefixes_and_evicts_the_least_recently_used():
    pool = PagePool(n_pages=5, page_size=2)  # pages 1..4
    assert pool.capacity == 4 and pool.available == 4
    a = [1, 2, 3, 4, 5]
    pages = pool.allocate(3)
    pool.publish(a, pages)  # two full pages published, the third (token 5) is partial
    assert pool.match([1, 2, 3, 4, 9]) == pages[:2]  # shared: now held twice
    assert pool.match([1, 2, 3, 4]) == pages[:1]  # at least one token is left to run
    assert pool.match([1, 2, 8]) == pages[:1] and pool.match([2, 2, 3]) == []
    pool.release(pages)  # the writer leaves; the sharers still hold the first two
    pool.release(pages[:2])
    pool.release(pages[:1])
    pool.release(pages[:1])
    assert pool.used == 0 and list(pool.idle) == [pages[1], pages[0]]  # cached, idle, oldest first
    pool.match([1, 2, 3, 4, 0])  # touches both again
    pool.release(pages[:2])
    fresh = pool.allocate(3)  # two free pages, then the least recently used idle page is evicted
    assert pages[0] in fresh and pool.match([1, 2, 3, 4, 0]) == []
    with pytest.raises(RuntimeError):
        pool.allocate(2)
    assert 0 not in fresh + pool.free  # page 0 belongs to padding


@pytest.mark.slow
def test_every_shape_is_compiled_by_warm_up(lm, monkeypatch):
    monkeypatch.setattr(batch, "MIN_DECODE_TOKENS", NARROW)
    engine = lm.engine(**ONE_ROW)
    shapes, _ = engine.warm_up()
    programs = engine.runner.shapes
    # one prefill program per shape serves rows that score their prompts and rows that do not
    assert shapes == len(programs.prefill_shapes()) + len(programs.decode_batches()) * len(programs.page_buckets())
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 512, n).tolist() for n in (1, 15, 16, 17, 40)]
    params = [greedy(int(m)) for m in (8, 30, 4, 20, 8)]
    params[1] = params[1].replace(temperature=0.7, seed=3)
    engine.generate(prompts, params, chunk=5)
    engine.generate(prompts[1:3], [greedy(0).replace(prompt_logprobs=2), greedy(3)])  # scored and plain rows mix
    assert engine.runner.compiles_since_warm_up == 0


@pytest.mark.slow
def test_a_second_warm_up_reads_its_shapes_back_from_the_compilation_cache(lm):
    """What `meshlm serve` reports on a restart: the suite keeps JAX's persistent cache in a folder of its own, here
    every program however quickly compiled, so an engine of the same settings as one warmed up before finds each
    of its shapes there."""
    kept = jax.config.jax_persistent_cache_min_compile_time_secs
    assert jax.config.jax_compilation_cache_dir, "the suite's conftest sets a compilation cache folder"
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    try:
        lm.engine(**ONE_ROW).warm_up()
        jax.clear_caches()  # as a new process starts: JAX's in-memory caches would serve the same programs
        again = lm.engine(**ONE_ROW)
        shapes, _ = again.warm_up()
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", kept)
    assert again.snapshot().cached_shapes == shapes > 0


def test_one_compile_listener_per_process_counts_into_each_warmed_runner_while_it_lives(monkeypatch):
    """JAX keeps a monitoring listener for the life of the process: however many warm-ups, one is registered; a
    runner counts the compilations since its latest warm-up, and one that is collected is no longer counted into."""
    registered = []
    register = jax.monitoring.register_event_duration_secs_listener

    def counting(listener):
        registered.append(listener)
        return register(listener)

    monkeypatch.setattr(jax.monitoring, "register_event_duration_secs_listener", counting)

    class Warmed:  # what the counter needs of a runner
        compiles_since_warm_up = 0

    counter, a, b = runner._CompileCounter(), Warmed(), Warmed()
    counter.count_into(a)
    counter.count_into(a)
    counter.count_into(b)
    c = float(np.random.default_rng().random())  # a program no cache holds
    jax.jit(lambda x: x * c)(np.arange(3.0))
    assert len(registered) == 1
    assert a.compiles_since_warm_up == b.compiles_since_warm_up >= 1
    b = weakref.ref(b)
    gc.collect()
    jax.jit(lambda x: x * (c + 1))(np.arange(3.0))
    assert b() is None and a.compiles_since_warm_up >= 2


def reference_scores(lm, prompt: list[int], k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each prompt token's logprob given the tokens before it, and the top-k of each of those distributions,
    from the model's full forward pass."""
    logits = lm.logits(np.asarray([prompt]))[0, :-1].astype(np.float64)
    logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)  # over the padded vocabulary
    top = np.argsort(-logp[:, : lm.config.n_vocab_used], axis=-1, kind="stable")[:, :k]
    return logp[np.arange(len(prompt) - 1), prompt[1:]], top, np.take_along_axis(logp, top, axis=-1)


@pytest.mark.slow
def test_scored_prompts_give_each_tokens_logprob_through_the_prefix_cache(lm, shared_prompts):
    """Prompt scoring (echo with logprobs): every prompt token's logprob and top alternatives equal the full
    forward pass's, for rows scored alone, batched, with 0 or more new tokens, and again once the shared
    opening pages are cached with their scores (a page cached by an unscored row is not used); then with
    scored and plain rows in one prefill."""
    engine = lm.engine(max_batch=4, page_size=PAGE, kv_tokens=FOUR_ROWS_KV)
    engine.generate(shared_prompts[:1], [greedy(2)])  # caches the opening's pages without scores
    budgets = (0, 2, 0, 1, 0, 3)
    tokens = []
    for round_ in range(3):
        scored = [round_ < 2 or i % 2 == 0 for i in range(len(budgets))]  # the last round mixes them
        params = [greedy(n).replace(prompt_logprobs=3 if s else None) for n, s in zip(budgets, scored, strict=True)]
        hits = engine.snapshot().prefix_cache_hits
        calls = engine.snapshot().prefill_calls
        got = engine.generate(shared_prompts, params)
        if round_ == 1:  # every prompt's full pages were cached with their scores, leaving each its last token
            found = engine.snapshot().prefix_cache_hits - hits
            assert found == sum((len(p) - 1) // PAGE * PAGE for p in shared_prompts)
        if round_ == 2:  # 4 rows, then 2: scored and plain rows share prefills
            assert engine.snapshot().prefill_calls - calls == 2
        for i, (prompt, completion, sp) in enumerate(zip(shared_prompts, got, params, strict=True)):
            assert len(completion.tokens) == sp.max_new_tokens
            if round_:
                assert completion.tokens == tokens[i]
            else:
                tokens.append(completion.tokens)
            if not scored[i]:
                assert completion.prompt_logprobs is None
                continue
            lp, top_ids, top_lps = reference_scores(lm, prompt, 3)
            assert completion.prompt_logprobs[0] is None and completion.prompt_top_logprobs[0] is None
            np.testing.assert_allclose(completion.prompt_logprobs[1:], lp, atol=1e-5, rtol=1e-5)
            for p, alternatives in enumerate(completion.prompt_top_logprobs[1:]):
                assert [i for i, _ in alternatives] == top_ids[p].tolist(), (round_, p)
                np.testing.assert_allclose([v for _, v in alternatives], top_lps[p], atol=1e-5, rtol=1e-5)
    assert engine.snapshot().kv_pages_used == 0


def test_a_one_token_prompt_scores_nothing_and_fails_no_one(lm, monkeypatch):
    """A one-token prompt with prompt logprobs has none to give but its first token's None (a prefill scoring no
    token returned no prompt logprobs, and reading them failed the step: every row of a server's engine); and a
    row whose scoring fails ends alone."""
    engine = lm.engine(max_batch=2, page_size=PAGE, kv_tokens=TWO_ROWS_KV)
    [plain] = engine.generate([[5]], [greedy(3)])
    [scored] = engine.generate([[5]], [greedy(3).replace(prompt_logprobs=1)])
    assert scored.prompt_logprobs == [None] and scored.prompt_top_logprobs == [None]
    assert scored.tokens == plain.tokens and len(plain.tokens) == 3

    real = engine.scheduler._score
    monkeypatch.setattr(engine.scheduler, "_score", lambda r, step, i: 1 / 0 if r.prompt[0] == 9 else real(r, step, i))
    requests = engine.add_requests([[9, 4, 2], [7, 4, 2]], [greedy(3).replace(prompt_logprobs=1)] * 2)
    while engine.has_work():
        engine.step(2)
    broken, beside = requests
    assert "division by zero" in broken.error and beside.error is None
    assert len(beside.output.tokens) == 3 and beside.output.prompt_logprobs[0] is None
    engine.step(2)  # the failed row's page, spoiled, is zeroed and freed by the next step
    assert engine.snapshot().kv_pages_used == 0


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    assert lookup([1, 2, 3, 4, 1, 2, 9, 1, 2], ngram=2, k=3) == [9, 1, 2]
    assert lookup([5, 6, 7, 6], ngram=3, k=2) == [7, 6]  # down to a one-token match
    assert lookup([5, 6, 7], ngram=2, k=2) == []
    assert lookup([1, 1], ngram=2, k=0) == []


@pytest.mark.slow
def test_speculative_decoding_is_token_identical_to_plain_greedy(lm, hf_tiny, shared_prompts):
    """Prompt lookup proposes 4 tokens per step; greedy rows keep the ones the model agrees with, so
    the output equals transformers' greedy generate while steps emit several tokens."""
    engine = lm.engine(max_batch=4, page_size=PAGE, kv_tokens=FOUR_ROWS_KV, ngram=3, speculate=4)
    repetitive = [p * 3 for p in shared_prompts[:3]]  # lookup finds continuations in the prompt itself
    budgets = [30, 12, 25]
    got = engine.generate(repetitive, [greedy(n) for n in budgets])
    for prompt, n, completion in zip(repetitive, budgets, got, strict=True):
        assert completion.tokens == hf_greedy(hf_tiny, prompt, n)[0]
    assert 0 < engine.scheduler.stats.accepted <= engine.scheduler.stats.proposed
    assert engine.scheduler.pool.used == 0


@pytest.fixture(scope="module")
def neox_draft(tmp_path_factory):
    """A smaller random GPT-NeoX with the tiny GPT-J's vocabulary: a draft of another architecture."""
    from tests import oracle

    folder = tmp_path_factory.mktemp("neox_draft")
    config = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=512)
    oracle.make_hf_model(folder, seed=9, model_type="gpt_neox", max_position_embeddings=128, **config)
    return meshlm.load(folder)


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["itself", "neox"])
def test_a_draft_model_leaves_greedy_output_token_identical(lm, hf_tiny, shared_prompts, neox_draft, draft):
    """The draft proposes 3 tokens per step and the target verifies them in one pass: with the target
    as its own draft every proposal is kept; with a GPT-NeoX draft few are. Either way each row equals
    transformers' greedy generate, rows joining mid-flight on 2 slots."""
    engine = lm.engine(draft=lm if draft == "itself" else neox_draft, max_batch=2, page_size=PAGE, kv_tokens=192,
                       speculate=3)  # fmt: skip
    budgets = [12, 5, 20, 9]
    got = engine.generate(shared_prompts[:4], [greedy(n) for n in budgets])
    for prompt, n, completion in zip(shared_prompts[:4], budgets, got, strict=True):
        assert completion.tokens == hf_greedy(hf_tiny, prompt, n)[0]
    assert 0 <= engine.scheduler.stats.accepted <= engine.scheduler.stats.proposed
    if draft == "itself":  # only proposals past a row's last token are lost
        assert engine.scheduler.stats.accepted >= 0.8 * engine.scheduler.stats.proposed
        # Sampling rows: the draft's q is computed as the target's p, so min(1, p/q) keeps every proposal.
        before = engine.snapshot()
        sampled = [greedy(16).replace(temperature=t, top_k=k, seed=i) for i, (t, k) in enumerate([(0.8, 0), (1.2, 40)])]
        engine.generate([[5] * 16, [9] * 16], sampled)  # 16 tokens: 1 from the prefill, then 4 + 4 + 4 + 3
        after = engine.snapshot()
        assert after.proposed - before.proposed == after.accepted - before.accepted == 2 * 4 * 3  # rows x steps x k
    assert engine.scheduler.pool.used == 0


def test_a_draft_model_must_share_the_vocabulary_and_context(lm, hf_tiny_gpt2_vocab):
    other = meshlm.load(hf_tiny_gpt2_vocab.path)
    with pytest.raises(ValueError, match="share the target's tokenizer"):
        lm.engine(draft=other)
    with pytest.raises(ValueError, match="not both"):
        lm.engine(draft=lm, ngram=3)
    with pytest.raises(ValueError, match="mesh"):
        lm.engine(draft=meshlm.load(lm.folder, mesh="data=2"))


@pytest.mark.slow
def test_every_process_samples_with_process_0s_seeds(lm, monkeypatch):
    """A row without a seed draws one on each host; in a multi-process job the engine broadcasts process
    0's, so every process feeds the devices the same settings (here two processes are simulated: the
    broadcast hands this process another process's seeds, and the row samples with them)."""
    from jax.experimental import multihost_utils

    monkeypatch.setattr(batch, "MIN_DECODE_TOKENS", NARROW)  # the warm-up test's shapes: compiled already
    engine = lm.engine(**ONE_ROW)
    params = [greedy(6).replace(temperature=1.0)]  # no seed
    broadcast = []

    def from_process_0(seeds):
        broadcast.append(seeds.copy())
        return np.full_like(seeds, 1234)

    with monkeypatch.context() as two_processes:
        two_processes.setattr(runner.jax, "process_count", lambda: 2)
        two_processes.setattr(multihost_utils, "broadcast_one_to_all", from_process_0)
        (got,) = engine.generate([[1, 2, 3]], params)
    assert len(broadcast) == 1
    (seeded,) = lm.engine(**ONE_ROW).generate([[1, 2, 3]], [params[0].replace(seed=1234)])
    assert got.tokens == seeded.tokens


@pytest.mark.slow
def test_decode_steps_by_the_paged_kernel_on_a_mesh_equal_transformers(hf_tiny, shared_prompts):
    """The Pallas paged-attention kernel (interpreted on CPU) reads the pool in decode steps, per shard of
    a mesh that splits rows over `data` x `fsdp` and heads over `model`; rows join mid-flight as before. The
    middle row scores its prompt, gathered across the rows' shards."""
    lm = meshlm.load(hf_tiny.path, mesh="data=2,fsdp=2,model=2")
    engine = lm.engine(attention="pallas", max_batch=2, page_size=PAGE, kv_tokens=160)
    budgets = [9, 4, 12]
    params = [greedy(n).replace(prompt_logprobs=2 if i == 1 else None) for i, n in enumerate(budgets)]
    got = engine.generate(shared_prompts[:3], params, chunk=4)
    for prompt, n, completion in zip(shared_prompts[:3], budgets, got, strict=True):
        assert completion.tokens == hf_greedy(hf_tiny, prompt, n)[0]
    lp, top_ids, _ = reference_scores(lm, shared_prompts[1], 2)
    np.testing.assert_allclose(got[1].prompt_logprobs[1:], lp, atol=1e-5, rtol=1e-5)
    assert [[i for i, _ in alts] for alts in got[1].prompt_top_logprobs[1:]] == top_ids.tolist()
