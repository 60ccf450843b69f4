"""lm-eval's own `local-completions` client against a live `meshlm serve`: it detects the server's tokenizer
(/tokenizer_info, /tokenize) and scores prompts through `echo` with `logprobs` on loglikelihood,
multiple-choice and rolling-perplexity tasks. Every request's loglikelihood equals `meshlm eval` in-process
and lm-eval's `hf` backend on the same model."""

import os
from pathlib import Path

import httpx
import pytest

from meshlm import evaluate
from tests.helpers.harness import harness, responses, unwrap
from tests.helpers.serving import serving

TASKS = ["meshlm_test_mc", "meshlm_test_lambada", "meshlm_test_wikitext"]
CONTEXT = 128  # the served model's context
# lm-eval's API client keeps one token of max_length for the answer: it sends the last 127 tokens of a long
# request and scores rolling windows of 126. The in-process backends feed max_length tokens after one more
# of context (and roll windows of max_length): 126 cuts every request where the client does.
MAX_LENGTH = f"max_length={CONTEXT - 2}"


@pytest.fixture(scope="module")
def served(hf_gptj):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    with serving([str(hf_gptj.path), "--max-batch", "4", "--model-name", "tiny"], env, start_within=240) as url:
        yield url


@pytest.fixture(scope="module")
def results(served, hf_gptj):
    client = f"model=tiny,base_url={served}/v1/completions,tokenizer_backend=auto,max_length={CONTEXT}"
    return {
        "server": harness("local-completions", client, batch_size=4, tasks=TASKS),
        "meshlm": harness("meshlm", f"pretrained={hf_gptj.path},{MAX_LENGTH}", batch_size=4, tasks=TASKS),
        "hf": harness("hf", f"pretrained={hf_gptj.path},dtype=float32,{MAX_LENGTH}", batch_size=1, tasks=TASKS),
    }


@pytest.mark.slow
def test_lm_eval_uses_the_servers_own_tokenizer(served):
    info = httpx.get(f"{served}/tokenizer_info").json()
    ids = httpx.post(f"{served}/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
    assert info and ids == [15496, 995]  # GPT-2 BPE


@pytest.mark.slow
@pytest.mark.parametrize("peer", ["meshlm", "hf"])
@pytest.mark.parametrize("task", TASKS)
def test_every_requests_loglikelihood_equals_the_in_process_backends(results, task, peer):
    expected, got = responses(results[peer], task), responses(results["server"], task)
    assert len(got) == len(expected) > 0
    for exp_doc, got_doc in zip(expected, got, strict=True):
        for exp_req, got_req in zip(exp_doc, got_doc, strict=True):
            exp_req, got_req = unwrap(exp_req), unwrap(got_req)
            if task == "meshlm_test_wikitext":  # a window's sum over ~127 tokens of float32 logprobs
                assert got_req == pytest.approx(exp_req, rel=1e-5, abs=1e-4)
            else:
                assert got_req[0] == pytest.approx(exp_req[0], rel=1e-5, abs=1e-5)
                assert got_req[1] == exp_req[1]


@pytest.mark.slow
def test_the_served_metrics_are_the_in_process_ones(results):
    served = evaluate.flatten_metrics(results["server"])
    for peer in ("meshlm", "hf"):
        expected = evaluate.flatten_metrics(results[peer])
        assert set(served) == set(expected)
        for key, value in expected.items():
            assert served[key] == pytest.approx(value, rel=1e-5), (peer, key)
