"""lm-eval integration: the `meshlm` model against lm-eval's own `hf` backend on the same random model (a
GPT-J with the GPT-2 BPE, a GPT-NeoX with a NeoX-style BPE, each the folder's own tokenizer), and `meshlm
eval --perplexity` against exp(mean NLL) from transformers' logits."""

import json
import math
import shutil

import numpy as np
import pytest
import torch

import meshlm
from meshlm import evaluate, tokenizer
from tests import oracle
from tests.helpers.harness import CONTEXT, TASK_DIR, harness, in_repo_root, responses, unwrap

MESH = "data=2,fsdp=2,model=2"


@pytest.fixture(scope="module")
def hf_neox(tmp_path_factory, neox_style_tokenizer) -> oracle.HFModel:
    """A random GPT-NeoX (Pythia's layout: two norms, rotate-half rotary on a quarter of each head, fused
    biased qkv) saved with a NeoX-style tokenizer.json whose <|endoftext|> is id 0."""
    folder = tmp_path_factory.mktemp("hf_neox_eval")
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    config = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256, vocab_size=512)
    hf = oracle.make_hf_model(
        folder, seed=4, model_type="gpt_neox", max_position_embeddings=CONTEXT, rope_parameters=rope, **config
    )
    for f in neox_style_tokenizer.iterdir():
        shutil.copy(f, folder)
    return hf


@pytest.fixture(scope="module", params=["gptj", "neox"])
def hf_model(request) -> oracle.HFModel:
    """Each architecture in turn, as a Hugging Face folder holding its own tokenizer."""
    return request.getfixturevalue(f"hf_{request.param}")


@pytest.fixture(scope="module")
def hf_results(hf_model):
    return harness("hf", f"pretrained={hf_model.path},dtype=float32", batch_size=1)


@pytest.fixture(scope="module")
def meshlm_results(hf_model):
    # The mesh spec travels inside lm-eval's comma-separated model_args; the tokenizer is the folder's own.
    return harness("meshlm", f"pretrained={hf_model.path},mesh=data=2,fsdp=2,model=2", batch_size=4)


@pytest.mark.slow
def test_meshlm_gives_the_hf_backends_metrics(hf_results, meshlm_results):
    expected = evaluate.flatten_metrics(hf_results)
    got = evaluate.flatten_metrics(meshlm_results)
    assert set(got) == set(expected) and "meshlm_test_wikitext/word_perplexity" in got
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-5), key


@pytest.mark.slow
@pytest.mark.parametrize("task", ["meshlm_test_mc", "meshlm_test_lambada", "meshlm_test_wikitext"])
def test_per_request_loglikelihoods_match_the_hf_backend(hf_results, meshlm_results, task):
    expected, got = responses(hf_results, task), responses(meshlm_results, task)
    assert len(got) == len(expected) > 0
    for exp_doc, got_doc in zip(expected, got, strict=True):
        for exp_req, got_req in zip(exp_doc, got_doc, strict=True):
            exp_req, got_req = unwrap(exp_req), unwrap(got_req)
            if task == "meshlm_test_wikitext":
                # A whole document's log-likelihood is about -4000 for the 325-token one, where one float32 step
                # is 2.4e-4 and the hf backend sums in float32: agreement to a few float32 steps.
                assert got_req == pytest.approx(exp_req, rel=2e-7, abs=1e-4)
            else:
                assert got_req[0] == pytest.approx(exp_req[0], abs=1e-4)
                assert got_req[1] == exp_req[1]


@pytest.mark.slow
def test_generate_until_matches_the_hf_backends_greedy_text(hf_results, meshlm_results):
    expected = responses(hf_results, "meshlm_test_gen")
    got = responses(meshlm_results, "meshlm_test_gen")
    assert got == expected
    assert all(len(r[0]) > 0 and "\n" not in r[0] and "." not in r[0] for r in got)


def reference_nlls(hf: oracle.HFModel, tokens: list[int], context: int, stride: int) -> np.ndarray:
    """Per-token NLLs straight from transformers' logits: token i (after a leading end-of-text) is scored
    by the window that first reaches it, windows of `context` inputs moving `stride` tokens at a time."""
    full = [tokenizer.EOT_ID, *tokens]
    nlls, scored = [], 1
    while scored < len(full):
        end = min(scored + (context if scored == 1 else stride), len(full))
        start = max(0, end - 1 - context)
        logprobs = torch.log_softmax(torch.as_tensor(hf.logits(np.array([full[start : end - 1]]))[0]), -1).numpy()
        targets = np.array(full[start + 1 : end])
        window = -logprobs[np.arange(len(targets)), targets]
        nlls.extend(window[-(end - scored) :])
        scored = end
    return np.array(nlls)


def run_cli(*argv: str) -> int:
    from meshlm import cli

    return cli.main(list(argv))


def test_perplexity_of_a_text_is_exp_mean_nll_from_transformers(hf_gptj, gpt2_bpe_file, tmp_path, capsys):
    text = "The quick brown fox jumps over the lazy dog. It was not amused, and neither was the cat."
    (tmp_path / "t.txt").write_text(text)
    ids = tokenizer.load_tokenizer(gpt2_bpe_file).encode(text)
    full = torch.as_tensor([[tokenizer.EOT_ID, *ids]])
    with torch.no_grad():
        logits = hf_gptj.torch_model(full).logits[0, :-1]
    expected = math.exp(torch.nn.functional.cross_entropy(logits, full[0, 1:]).item())

    out = tmp_path / "ppl.json"
    assert run_cli("eval", str(hf_gptj.path), "--perplexity", str(tmp_path / "t.txt"), "--tokenizer", gpt2_bpe_file,
                   "--mesh", MESH, "--batch-size", "4", "--output", str(out)) == 0  # fmt: skip
    result = json.loads(out.read_text())
    assert result["tokens"] == len(ids) and result["documents"] == 1
    assert result["perplexity"] == pytest.approx(expected, rel=1e-5)
    assert f"over {len(ids)} tokens in 1 document(s)" in capsys.readouterr().out


def test_strided_perplexity_over_jsonl_documents(hf_gptj, gpt2_bpe_file, tmp_path):
    docs = [json.loads(line)["text"] for line in (TASK_DIR / "data" / "docs.jsonl").read_text().splitlines()]
    assert evaluate.read_documents(TASK_DIR / "data" / "docs.jsonl") == docs  # what `--perplexity` reads
    tok = tokenizer.load_tokenizer(gpt2_bpe_file)
    stride = 48
    nlls = np.concatenate([reference_nlls(hf_gptj, tok.encode(d), CONTEXT, stride) for d in docs])
    assert len(nlls) > 2 * CONTEXT  # the long document needs several overlapping windows

    lm = meshlm.load(hf_gptj.path, mesh=MESH)
    result = evaluate.perplexity(lm, docs, tok, stride=stride, batch_size=4)
    assert result["tokens"] == len(nlls)
    assert result["nll"] == pytest.approx(nlls.mean(), abs=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(nlls.mean()), rel=1e-5)


@pytest.mark.slow
def test_eval_cli_prints_the_table_and_writes_the_harness_json(hf_model, hf_results, tmp_path, capsys):
    out = tmp_path / "results.json"
    with in_repo_root():
        code = run_cli("eval", str(hf_model.path), "--tasks", "meshlm_test_mc,meshlm_test_lambada",
                       "--include-path", str(TASK_DIR), "--mesh", MESH, "--batch-size", "4",
                       "--output", str(out))  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "|meshlm_test_mc" in printed and "acc_norm" in printed
    metrics = evaluate.flatten_metrics(json.loads(out.read_text()))
    expected = evaluate.flatten_metrics(hf_results)
    for key in ("meshlm_test_mc/acc", "meshlm_test_mc/acc_norm", "meshlm_test_lambada/perplexity"):
        assert metrics[key] == pytest.approx(expected[key], rel=1e-5)


def test_eval_cli_errors_are_one_line(hf_gptj, tmp_path, capsys):
    assert run_cli("eval", str(hf_gptj.path)) == 1
    assert "meshlm eval: error: give exactly one of --tasks or --perplexity" in capsys.readouterr().err
    assert run_cli("eval", str(hf_gptj.path), "--perplexity", str(tmp_path / "missing.txt")) == 1
    assert "missing.txt: no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text"}\n')
    assert run_cli("eval", str(hf_gptj.path), "--perplexity", str(bad)) == 1
    assert "bad.jsonl:2: no 'text' field (choose the field with --text-field)" in capsys.readouterr().err
    text = tmp_path / "text.txt"
    text.write_text("a few words")
    for output in (tmp_path, tmp_path / "no-such-folder" / "out.json"):  # refused before the model loads
        assert run_cli("eval", str(hf_gptj.path), "--perplexity", str(text), "--output", str(output)) == 1
        assert f"--output {output}: cannot write a file there" in capsys.readouterr().err


@pytest.mark.slow
def test_evaluate_tasks_gives_flat_metrics_for_a_loaded_model(hf_model, hf_results):
    lm = meshlm.load(hf_model.path, mesh=MESH)
    with in_repo_root():
        metrics = evaluate.evaluate_tasks(lm, ["meshlm_test_lambada"], include_path=TASK_DIR, batch_size=4)
    expected = evaluate.flatten_metrics(hf_results)
    assert set(metrics) == {"meshlm_test_lambada/perplexity", "meshlm_test_lambada/acc"}
    for key, value in metrics.items():
        assert value == pytest.approx(expected[key], rel=1e-5)


@pytest.mark.slow
def test_training_logs_harness_metrics_of_its_current_weights(hf_gptj, gpt2_bpe_file, tmp_path, monkeypatch):
    """`eval_tasks`/`eval_every` in the train config: the logged metrics are those of the weights at that step."""
    from meshlm import data, train
    from meshlm.config import ConfigError, TrainConfig

    monkeypatch.setenv("MESHLM_TOKENIZER", gpt2_bpe_file)
    rows = np.random.default_rng(0).integers(0, 50257, (8, 17))
    data.write_index(tmp_path / "data", 16, {"train": data.write_split(tmp_path / "data", "train", [rows], 16)})
    cfg = TrainConfig(
        model=meshlm.load(hf_gptj.path).config, data=str(tmp_path / "data"), out_dir=str(tmp_path / "run"),
        init_from=str(hf_gptj.path), batch_size=4, total_steps=2, lr=1e-3, warmup_steps=0, anneal_steps=2,
        val_every=0, ckpt_every=0, sample_tokens=0, eval_tasks=["meshlm_test_lambada"], eval_every=2,
        eval_include_path=str(TASK_DIR),
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"eval_tasks are run by an evaluator handed to train\(\)"):
        train.train(cfg, progress=False)  # the loop imports no evaluator of its own
    with in_repo_root():
        result = train.train(cfg, progress=False, sample=False, evaluate_tasks=evaluate.evaluate_tasks)
        expected = evaluate.evaluate_tasks(result.lm, ["meshlm_test_lambada"], include_path=TASK_DIR)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = {k: v for r in records if r["step"] == 2 for k, v in r.items() if k.startswith("eval/")}
    assert set(logged) == {"eval/meshlm_test_lambada/perplexity", "eval/meshlm_test_lambada/acc"}
    assert logged == {f"eval/{k}": pytest.approx(v, rel=1e-6) for k, v in expected.items()}


@pytest.mark.slow
def test_an_adapter_gives_the_hf_backends_metrics_with_peft(hf_gptj, tmp_path):
    """`adapter=` against lm-eval's hf backend with `peft=`, on the same random LoRA adapter, unmerged."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    settings = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "fc_out"], init_lora_weights=False)
    get_peft_model(oracle.load_hf(hf_gptj.path), settings).save_pretrained(tmp_path / "adapter")
    tasks = ["meshlm_test_mc", "meshlm_test_gen"]
    args = f"pretrained={hf_gptj.path},dtype=float32"
    expected = harness("hf", f"{args},peft={tmp_path / 'adapter'}", batch_size=1, tasks=tasks)
    got = harness("meshlm", f"{args},adapter={tmp_path / 'adapter'}", batch_size=4, tasks=tasks)
    assert responses(got, "meshlm_test_gen") == responses(expected, "meshlm_test_gen")
    tokens = np.arange(16)[None]
    with_adapter = meshlm.load(hf_gptj.path, adapter=tmp_path / "adapter").logits(tokens)
    assert np.abs(with_adapter - hf_gptj.logits(tokens)).max() > 0.1  # the adapter matters
    for exp_doc, got_doc in zip(*(responses(r, "meshlm_test_mc") for r in (expected, got)), strict=True):
        for exp_req, got_req in zip(exp_doc, got_doc, strict=True):
            assert unwrap(got_req)[0] == pytest.approx(unwrap(exp_req)[0], abs=1e-4)
