"""The serving wing's host side imports no jax: the scheduler and the contract it shares with the runner
(`batch`, `params`, `outputs`, `pages`) run without a device. And the wing's deprecated re-exports still answer,
with a warning."""

import importlib
import subprocess
import sys
import warnings
from types import SimpleNamespace

import numpy as np
import pytest

import meshlm.generate
import meshlm.grammar
from meshlm.serve.batch import Step
from meshlm.serve.outputs import RowOutput
from meshlm.serve.params import TOP_LOGPROBS, SamplingParams
from meshlm.tokenizer import load_tokenizer

HOST_ONLY = ["scheduler", "batch", "params", "outputs", "pages"]


def test_the_scheduler_and_the_contract_import_no_jax():
    imports = "; ".join(f"import meshlm.serve.{m}" for m in HOST_ONLY)
    code = f"import sys; {imports}; print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("old", "name", "new"),
    [
        ("meshlm.generate", "SamplingParams", "meshlm.serve.params"),
        ("meshlm.generate", "RowOutput", "meshlm.serve.outputs"),
        ("meshlm.generate", "settings_for", "meshlm.serve.batch"),
        ("meshlm.grammar", "Constraint", "meshlm.serve.grammar"),
    ],
)
def test_deprecated_imports_warn_and_give_the_same_object(old, name, new):
    old_module, new_module = importlib.import_module(old), importlib.import_module(new)
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        got = getattr(old_module, name)
    assert got is getattr(new_module, name)


def test_a_name_the_old_module_never_had_is_an_attribute_error():
    with warnings.catch_warnings(), pytest.raises(AttributeError):
        warnings.simplefilter("error")
        meshlm.generate.no_such_name  # noqa: B018


# Texts of multi-byte characters (GPT-2 BPE splits all but the accents): accents, CJK, emoji, a joiner sequence.
TRICKY = [
    "héllo wörld, naïve café",
    "日本語のテキストを書く",
    "emoji 😀🎉 \U0001f469\u200d\U0001f467 end",
    "∑∫≠ Ünïcödé \U0001d518\U0001d52b",
]


def step_of(token: np.ndarray) -> Step:
    """A device call's output that gives each row its row of `token` [rows, steps], every step emitted."""
    rows, n = token.shape
    tops = (rows, n, TOP_LOGPROBS)
    return Step(token, np.zeros((rows, n), np.float32), np.zeros(tops, np.int32), np.zeros(tops, np.float32),
                np.ones((rows, n), bool), np.zeros(rows, bool))  # fmt: skip


def one_step(tokens: list[int]) -> Step:
    """A chunk of steps that gives row 0 `tokens`."""
    return step_of(np.array([tokens], np.int32))


def streamed_texts(tok, ids: list[int], chunk: int) -> list[str]:
    """A row's text after each chunk of its tokens arrives."""
    out, texts = RowOutput(SamplingParams(max_new_tokens=len(ids)), tok), []
    for i in range(0, len(ids), chunk):
        out.add(one_step(ids[i : i + chunk]), 0)
        texts.append(out.text)
    return texts


@pytest.mark.parametrize("chunk", [1, 3])
def test_the_incremental_text_is_the_whole_decoding_at_every_step(gpt2_bpe_file, chunk):
    tok = load_tokenizer(gpt2_bpe_file)
    assert tok.byte_level
    rng = np.random.default_rng(0)
    garbage = rng.integers(0, tok.vocab_size, 200).tolist()  # invalid and unfinished UTF-8 mid-row
    rows = [*(tok.encode(t) for t in TRICKY), garbage]
    assert sum("\ufffd" in tok.decode([i]) for ids in rows for i in ids) > 30  # tokens that split a character
    for ids in rows:
        want = [tok.decode(ids[: i + chunk]) for i in range(0, len(ids), chunk)]
        assert streamed_texts(tok, ids, chunk) == want


def test_the_incremental_text_decodes_each_token_about_once(gpt2_bpe_file):
    tok = load_tokenizer(gpt2_bpe_file)
    decoded = []
    counting = SimpleNamespace(byte_level=True, decode=lambda ids: decoded.append(len(ids)) or tok.decode(ids))
    ids = tok.encode(" ".join(TRICKY) * 4)
    texts = streamed_texts(counting, ids, 1)
    assert texts[-1] == tok.decode(ids)
    assert sum(decoded) < 2 * len(ids)  # decoded whole at every step, it would be len(ids) ** 2 / 2


def test_a_step_prefills_at_most_prefill_tokens_and_a_scored_prompt_runs_whole():
    """Host-only: with prefill_tokens 20 over pages of 4 a prompt's chunk is 16 tokens (the largest prompt bucket of
    whole pages within 20); a 41-token prompt runs its first chunk alone, a short prompt waiting for the next step
    (16 + 5 > 20); a 20-token prompt, within the budget, runs whole; so does a scored 41-token prompt, its scores
    coming from one call. A budget below a page is refused."""
    from meshlm.config import InputError
    from meshlm.serve.batch import Shapes
    from meshlm.serve.scheduler import Request, Scheduler

    def rows(scheduler: Scheduler) -> list[int]:
        return [int(batch.mask.sum()) for _, batch in scheduler.schedule_prefill()]

    def request(n: int, **changes) -> Request:
        return Request(list(range(1, n + 1)), RowOutput(SamplingParams(max_new_tokens=3, **changes), None))

    shapes = Shapes.of(max_batch=4, max_len=64, page_size=4, batch_ways=1)
    scheduler = Scheduler(shapes, n_pages=64, vocab_size=512, prefill_tokens=20)
    assert scheduler.prompt_chunk == 16
    long, short = request(41), request(5)
    scheduler.submit([long, short])
    assert rows(scheduler) == [16] and long.prefilling and scheduler.decoding == []
    for whole in (request(20), request(41, prompt_logprobs=1)):
        scheduler = Scheduler(shapes, n_pages=64, vocab_size=512, prefill_tokens=20)
        scheduler.submit([whole])
        assert rows(scheduler) == [len(whole.prompt)]
    with pytest.raises(InputError, match="prefill_tokens"):
        Scheduler(shapes, n_pages=64, vocab_size=512, prefill_tokens=3)


def produced(batch) -> Step:
    """What a device call of `batch` returns, every row emitting token 7: the scheduler run without a device."""
    from meshlm.serve.batch import Decode

    return step_of(np.full((batch.slots.shape[0], batch.chunk if isinstance(batch, Decode) else 1), 7, np.int32))


@pytest.mark.parametrize(
    ("second", "budget", "pieces"),
    [("the same", 20, [[(0, 16)], [(0, 16)], [(0, 9)], [(1, 1)]]),
     ("another", 20, [[(0, 16)], [(0, 16)], [(0, 9)], [(1, 16)], [(1, 16)], [(1, 9)]]),
     ("another", 40, [[(0, 16), (1, 16)], [(0, 25)], [(1, 25)]])],
)  # fmt: skip
def test_prompts_being_prefilled_keep_to_the_steps_budget_and_compute_a_shared_prefix_once(second, budget, pieces):
    """Host-only, two 41-token prompts queued together over pages of 4, chunks of 16 (prefill_tokens 20 or 40). At 20
    the first runs 16, 16 and 9 tokens over three steps. The same prompt again waits for the pages the first is still
    to write, then finds 40 tokens cached and runs 1 (it had run all but the first chunk again); another prompt waits
    until a chunk fits what the step has left (the first's last 9 and its 16 would be 25). At 40 both start with a
    chunk; then the first's rest (25) fits and runs whole, and the second's waits a step (each rest whole was 50)."""
    from meshlm.serve.batch import Shapes
    from meshlm.serve.scheduler import Request, Scheduler

    shapes = Shapes.of(max_batch=4, max_len=64, page_size=4, batch_ways=1)
    scheduler = Scheduler(shapes, n_pages=64, vocab_size=512, prefill_tokens=budget)
    prompt = list(range(1, 42))
    rows = [Request(p, RowOutput(SamplingParams(max_new_tokens=2), None))
            for p in (prompt, prompt if second == "the same" else [t + 100 for t in prompt])]  # fmt: skip
    scheduler.submit(rows)
    steps = []
    while scheduler.has_work():
        step = []
        for work in scheduler.schedule_prefill():
            step += [(rows.index(r), int(work.batch.mask[i].sum())) for i, r in enumerate(work.rows)]
            scheduler.update(work, produced(work.batch))
        if (work := scheduler.schedule_decode(1)) is not None:
            scheduler.update(work, produced(work.batch))
        steps.append(sorted(step))
    assert steps[: len(pieces)] == pieces
    assert scheduler.pool.hits == (40 if second == "the same" else 0)
    assert all(len(r.output.tokens) == 2 for r in rows)
