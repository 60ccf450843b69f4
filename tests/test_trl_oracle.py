"""Self-checks of the trl oracle (tests/trl_oracle.py): that it runs trl the way it says, and that trl's step-1
numbers equal the conventions of benchmarks/results/trl_conventions.md computed by hand from the transformers model.
These check the oracle, not meshlm."""

import json
import math

import numpy as np
import pytest
import torch

pytest.importorskip("trl")

from tests import trl_oracle as T


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return T.write_hf_folder(tmp_path_factory.mktemp("trl_tiny"), chat_template=True, seed=3)


@pytest.fixture(scope="module")
def model(folder):
    return T.load_torch_model(folder)


@pytest.fixture(scope="module")
def tok(folder):
    return T.load_tokenizer(folder)


def token_logps(model, ids: list[int]) -> np.ndarray:
    """log p(ids[t] | ids[:t]) for t = 1 .. len(ids) - 1, from the model's full logits."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    logp = torch.log_softmax(logits[:-1], -1)
    return logp.gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1).numpy()


def test_folder_layout(folder, tmp_path):
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "gptj" and config["resid_pdrop"] == config["attn_pdrop"] == 0.0
    assert json.loads((folder / "tokenizer_config.json").read_text())["chat_template"] == T.CHATML_TEMPLATE
    jinja = T.write_hf_folder(tmp_path / "jinja", chat_template=True, chat_template_file="jinja")
    assert (jinja / "chat_template.jinja").read_text() == T.CHATML_TEMPLATE
    assert "chat_template" not in json.loads((jinja / "tokenizer_config.json").read_text())
    tok = T.load_tokenizer(jinja)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 0, None)
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]


def test_meshlm_reads_the_same_weights(folder, model, tok):
    import meshlm

    ids = np.array([tok("The sky is blue.<|endoftext|>")["input_ids"]])
    with torch.no_grad():
        want = model(torch.as_tensor(ids)).logits.numpy()
    got = meshlm.load(folder).logits(ids)
    np.testing.assert_allclose(got[..., : want.shape[-1]], want, atol=1e-4)


def test_sft_step1_is_completion_only_token_mean(folder, model, tok):
    """Step 1's loss: the mean over every completion token of the step's records (EOS included, prompt excluded),
    not a mean of per-record means; here one step of 2 records, as 2 micro-batches of 1."""
    records = T.sft_records()[:2]
    total, count = 0.0, 0
    for r in records:
        n_prompt = len(tok(r["prompt"])["input_ids"])
        ids = tok(r["prompt"] + r["completion"] + tok.eos_token)["input_ids"]
        assert ids[-1] == tok.eos_token_id and ids[:n_prompt] == tok(r["prompt"])["input_ids"]
        lp = token_logps(model, ids)[n_prompt - 1 :]
        total, count = total - lp.sum(), count + len(lp)
    losses = T.sft_losses(folder, records, steps=1, batch_size=1, grad_accum=2)
    assert losses[0] == pytest.approx(total / count, abs=1e-5)


def test_sft_chat_step1_is_assistant_only(folder, model, tok):
    """Chats: the loss is on the assistant turns only, each one's content and its <|im_end|>, not the newline after."""
    records = T.chat_records()[:2]
    total, count = 0.0, 0
    for r in records:
        ids, mask = [], []
        for m in r["messages"]:
            head = tok(f"<|im_start|>{m['role']}\n")["input_ids"]
            body = tok(m["content"] + "<|im_end|>")["input_ids"]
            tail = tok("\n")["input_ids"]
            ids += head + body + tail
            mask += [0] * len(head) + [int(m["role"] == "assistant")] * len(body) + [0] * len(tail)
        assert ids == tok.apply_chat_template(r["messages"], tokenize=True, return_dict=True)["input_ids"]
        lp = token_logps(model, ids)
        weights = np.array(mask[1:])
        total, count = total - (lp * weights).sum(), count + weights.sum()
    losses = T.sft_losses(folder, records, steps=1, batch_size=2)
    assert losses[0] == pytest.approx(total / count, abs=1e-5)


def dpo_logps(model, tok, r) -> tuple[float, float]:
    prompt = tok(r["prompt"])["input_ids"]
    out = []
    for key in ("chosen", "rejected"):
        ids = tok(r["prompt"] + r[key] + tok.eos_token)["input_ids"]
        out.append(float(token_logps(model, ids)[len(prompt) - 1 :].sum()))
    return out[0], out[1]


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_dpo_step1(folder, model, tok, loss_type):
    """At step 1 the policy is the reference: every reward is 0, so the sigmoid loss is log 2, IPO's is
    (1 / (2 beta))^2, the hinge's 1; accuracies count chosen > rejected strictly (0 here); logps are summed over the
    completion tokens (EOS included)."""
    records, beta = T.preference_records()[:2], 0.25
    logs = T.dpo_metrics(folder, records, steps=1, batch_size=2, beta=beta, loss_type=loss_type)
    want = {"sigmoid": math.log(2), "ipo": (1 / (2 * beta)) ** 2, "hinge": 1.0}[loss_type]
    assert logs[0]["loss"] == pytest.approx(want, abs=1e-6)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert logs[0][key] == 0.0
    logps = np.array([dpo_logps(model, tok, r) for r in records])
    assert logs[0]["logps/chosen"] == pytest.approx(logps[:, 0].mean(), abs=1e-4)
    assert logs[0]["logps/rejected"] == pytest.approx(logps[:, 1].mean(), abs=1e-4)


@pytest.mark.slow
def test_dpo_moves_and_is_deterministic(folder):
    records = T.preference_records()
    a = T.dpo_metrics(folder, records, steps=3, batch_size=2, lr=1e-3)
    b = T.dpo_metrics(folder, records, steps=3, batch_size=2, lr=1e-3)
    assert a == b  # bit-identical
    assert [x["step"] for x in a] == [1, 2, 3]
    assert a[2]["rewards/margins"] != 0.0 and a[2]["loss"] != pytest.approx(math.log(2))
    assert set(T.DPO_KEYS) <= set(a[0])


@pytest.mark.slow
def test_sft_is_deterministic(folder):
    a = T.sft_losses(folder, T.sft_records(), steps=3, batch_size=2)
    assert a == T.sft_losses(folder, T.sft_records(), steps=3, batch_size=2)
    assert len(a) == 3 and a[2] < a[0]


@pytest.mark.slow
def test_dpo_precomputed_reference_equals_on_the_fly(folder):
    records = T.preference_records()
    on_the_fly = T.dpo_metrics(folder, records, steps=3, batch_size=2, loss_type="ipo")
    precomputed = T.dpo_metrics(folder, records, steps=3, batch_size=2, loss_type="ipo", precompute_ref_log_probs=True)
    for a, b in zip(on_the_fly, precomputed, strict=True):
        for key in T.DPO_KEYS:
            assert a[key] == pytest.approx(b[key], abs=1e-6)


def test_dpo_lora_starts_at_the_base(folder, tmp_path):
    """peft's LoRA init has B = 0: the adapter starts as a no-op, so step 1 equals full fine-tuning's step 1; the
    adapter saved before the first step is what the meshlm side must start from."""
    records = T.preference_records()
    full = T.dpo_metrics(folder, records, steps=1, batch_size=2)
    lora = T.dpo_metrics(folder, records, steps=2, batch_size=2, lora=T.lora_config(), save_initial_adapter=tmp_path)
    assert lora[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert lora[0]["logps/chosen"] == pytest.approx(full[0]["logps/chosen"], abs=1e-5)
    assert lora[1]["rewards/margins"] != 0.0
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "adapter_model.safetensors")
    assert weights and all(not w.any() for name, w in weights.items() if "lora_B" in name)
    assert any(w.any() for name, w in weights.items() if "lora_A" in name)


def test_orpo_step1(folder, model, tok):
    """ORPO: BOS is put before the prompt and EOS after each completion; the NLL term is the token mean over the
    chosen rows' every token (prompt too); the odds-ratio term uses per-token mean log-probs of the completions."""
    records, beta = T.preference_records()[:2], 0.2
    nll_sum, nll_count, chosen, rejected = 0.0, 0, [], []
    for r in records:
        prompt = [tok.bos_token_id, *tok(r["prompt"], add_special_tokens=False)["input_ids"]]
        for key, out in (("chosen", chosen), ("rejected", rejected)):
            ids = [tok.bos_token_id, *tok(r["prompt"] + r[key], add_special_tokens=False)["input_ids"]]
            ids.append(tok.eos_token_id)
            lp = token_logps(model, ids)
            out.append(lp[len(prompt) - 1 :].mean())
            if key == "chosen":
                nll_sum, nll_count = nll_sum - lp.sum(), nll_count + len(lp)
    lc, lr = np.array(chosen), np.array(rejected)
    log_odds = (lc - lr) - (np.log1p(-np.exp(lc)) - np.log1p(-np.exp(lr)))
    ratio = -np.log1p(np.exp(-log_odds))
    nll = nll_sum / nll_count
    logs = T.orpo_metrics(folder, records, steps=1, batch_size=2, beta=beta)
    assert logs[0]["nll_loss"] == pytest.approx(nll, abs=1e-5)
    assert logs[0]["loss"] == pytest.approx(nll - beta * ratio.mean(), abs=1e-5)
    assert logs[0]["log_odds_ratio"] == pytest.approx(ratio.mean(), abs=1e-5)
    assert logs[0]["log_odds_chosen"] == pytest.approx(log_odds.mean(), abs=1e-5)
    assert logs[0]["rewards/chosen"] == pytest.approx(beta * lc.mean(), abs=1e-5)
    assert logs[0]["rewards/margins"] == pytest.approx(beta * (lc - lr).mean(), abs=1e-5)
    assert logs[0]["logps/rejected"] == pytest.approx(lr.mean(), abs=1e-5)


def test_records_must_fill_whole_steps(folder):
    with pytest.raises(ValueError, match="multiple of batch_size"):
        T.sft_losses(folder, T.sft_records()[:3], steps=1, batch_size=2)
