"""The independent oracle for post-training: trl's own trainers (SFTTrainer, DPOTrainer, ORPOTrainer) run for a few
optimizer steps on a tiny random GPT-J (transformers, torch, fp32, CPU), returning what trl logs at each step; and
GRPOTrainer's advantage and loss code on supplied completions, rewards and log-probs (`grpo_step`).

meshlm's SFT / DPO / ORPO training is compared with these numbers step for step. Everything that would make trl's
numbers differ from "plain" math is switched off here (benchmarks/results/trl_conventions.md explains each choice):

- fp32 everywhere: trl's configs default to `bf16=True`, so `bf16=False` is passed explicitly;
- AdamW as `optim="adamw_torch"` (torch.optim.AdamW, betas 0.9/0.999, eps 1e-8), `weight_decay` as given (0 default),
  constant learning rate (`lr_scheduler_type="constant"`, no warmup), no gradient clipping (`max_grad_norm=0`: the
  Trainer clips only when `max_grad_norm > 0`);
- no dropout anywhere (the model config sets every dropout to 0; trl's `disable_dropout` is on for DPO and ORPO);
- no gradient checkpointing (trl defaults it on; it does not change the math, only the speed);
- data order: `train_sampling_strategy="sequential"`, so optimizer step k (0-based) sees records
  `[k*B*A, (k+1)*B*A)` (B = `batch_size`, A = `grad_accum`), wrapping round to the start when the records run out
  (a new epoch, same order). The number of records must be a multiple of B*A;
- no packing, no padding-free, no truncation in practice (`max_length=1024`, far above the tiny examples).

Step k's logged values are computed in the forward pass of step k, i.e. *before* step k's optimizer update: step 1's
loss is the loss of the initial weights.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Only trl-specific switches here: the process's other tests (W&B offline mode, ...) share the environment. Telemetry
# is switched off around each run (`_quiet`), trackers by `report_to="none"`.
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # ORPOTrainer lives in trl.experimental
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch
from transformers import AutoTokenizer, TrainerCallback

from tests.oracle import random_model

# A ChatML template whose assistant turns are wrapped in `{% generation %}` markers, which trl's
# `assistant_only_loss` needs (transformers' `return_assistant_tokens_mask`). The assistant's `<|im_end|>` is inside
# the markers (so it is trained); the newline after it is not.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}"
    "{{ message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2

# The tiny GPT-J every oracle test uses (the same sizes as tests/conftest.py's `hf_tiny`), with dropout off.
TINY_GPTJ = dict(
    n_embd=64,
    n_layer=2,
    n_head=4,
    rotary_dim=8,
    vocab_size=512,
    n_positions=128,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
)

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc_in", "fc_out"]


_CORPUS = """\
Question: What is the capital of France? Answer: Paris is the capital of France.
The quick brown fox jumps over the lazy dog. The sky is blue and the grass is green.
Hello! How are you? I am fine, thank you. What colour is the sky? It is blue.
user assistant system You are a helpful assistant. Please answer the question.
The cat sat on the mat. A dog is not a cat. One, two, three, four, five, six, seven.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 2024. Yes, no, maybe; (this) [that] {other} "quoted" 'single'.
In the beginning the model knows nothing; after training it answers questions about colours and capitals.
"""


def _corpus() -> list[str]:
    """The tiny tokenizer's training text: fixed here (not read from other files), so its ids never drift; the usual
    words of the sample records are single tokens."""
    return _CORPUS.splitlines() * 20


def make_tokenizer(folder: str | Path | None = None, *, vocab_size: int = 512):
    """A byte-level BPE of at most `vocab_size` ids (493 with the fixed corpus) trained here (no hub), laid out like
    GPT-J's: `<|endoftext|>` (id 0) is
    BOS, EOS and UNK, no pad token (trl pads with EOS); `<|im_start|>` (1) and `<|im_end|>` (2) are special tokens for
    ChatML. Saved to `folder` when given. Returns the `PreTrainedTokenizerFast`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    special = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, additional_special_tokens=["<|im_start|>", "<|im_end|>"], **special
    )
    if folder is not None:
        fast.save_pretrained(str(folder))
    return fast


def write_hf_folder(
    folder: str | Path,
    *,
    seed: int = 0,
    std: float = 0.2,
    chat_template: str | bool | None = None,
    chat_template_file: str = "tokenizer_config",
    **config: Any,
) -> Path:
    """Write a Hugging Face GPT-J folder that `meshlm.load(folder)` and trl both read: `config.json`,
    `model.safetensors` (every weight random, N(0, std²), layer norms N(1, std²)), `generation_config.json` and the
    tokenizer files (`tokenizer.json`, `tokenizer_config.json`, `special_tokens_map.json` where transformers writes it).

    `chat_template`: None for no template; True for `CHATML_TEMPLATE` (ChatML with `{% generation %}` markers); or a
    template string. `chat_template_file`: "tokenizer_config" puts it under `chat_template` in `tokenizer_config.json`;
    "jinja" writes `chat_template.jinja` instead (transformers' newer layout). `config` overrides `TINY_GPTJ`
    (`vocab_size`, 512, must hold the tokenizer's 493 ids; the
    19 rows above them are never a token, like GPT-J's 143 padding rows). Returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer()
    if chat_template is True:
        chat_template = CHATML_TEMPLATE
    if chat_template:
        tokenizer.chat_template = chat_template
    if chat_template_file not in ("tokenizer_config", "jinja"):
        raise ValueError(f"chat_template_file must be 'tokenizer_config' or 'jinja', not {chat_template_file!r}")
    tokenizer.save_pretrained(str(folder), save_jinja_files=chat_template_file == "jinja")
    cfg = {**TINY_GPTJ, **config}
    if cfg["vocab_size"] < len(tokenizer):
        raise ValueError(f"vocab_size {cfg['vocab_size']} < the tokenizer's {len(tokenizer)} ids")
    cfg.setdefault("bos_token_id", tokenizer.bos_token_id)
    cfg.setdefault("eos_token_id", tokenizer.eos_token_id)
    model = random_model("gptj", seed=seed, std=std, **cfg)
    with _quiet():
        model.save_pretrained(str(folder))
    return folder


def load_torch_model(model_dir: str | Path):
    """The folder's model as transformers loads it, in fp32, in eval mode."""
    from transformers import AutoModelForCausalLM

    with _quiet():
        return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def load_tokenizer(model_dir: str | Path):
    return AutoTokenizer.from_pretrained(str(model_dir))


# ---------------------------------------------------------------------------------------------------------------------
# Running trl


class _LogCapture(TrainerCallback):
    """Every training log (one per optimizer step with `logging_steps=1`); the final summary log is left out."""

    def __init__(self):
        self.logs: list[dict[str, float]] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs and "train_runtime" not in logs:
            self.logs.append({"step": state.global_step, **logs})


def _common_args(
    output_dir: str, *, steps: int, batch_size: int, grad_accum: int, lr: float, weight_decay: float, seed: int
) -> dict[str, Any]:
    return dict(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=grad_accum,
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        weight_decay=weight_decay,
        max_grad_norm=0.0,  # Trainer clips only when max_grad_norm > 0
        bf16=False,  # trl's configs default to bf16=True
        fp16=False,
        use_cpu=True,
        gradient_checkpointing=False,  # trl's configs default to True
        train_sampling_strategy="sequential",
        dataloader_drop_last=False,
        dataloader_num_workers=0,
        logging_steps=1,
        logging_strategy="steps",
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=seed,
        data_seed=seed,
        dataset_num_proc=None,
    )


def _check_records(records: list[dict], batch_size: int, grad_accum: int) -> None:
    if not records:
        raise ValueError("no records")
    if len(records) % (batch_size * grad_accum):
        raise ValueError(
            f"{len(records)} records is not a multiple of batch_size * grad_accum = {batch_size * grad_accum}"
        )


@contextlib.contextmanager
def _quiet():
    """trl, transformers and datasets print progress bars and advice: keep the test output clean; and trl's trainers
    ping the Hub (telemetry) when built: switch that off. The previous settings come back afterwards."""
    import datasets
    from huggingface_hub import constants as hub_constants
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    data_bars = datasets.is_progress_bar_enabled()
    trl_logger = logging.getLogger("trl")
    trl_level = trl_logger.level
    tqdm_disable = os.environ.get("TQDM_DISABLE")
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    datasets.disable_progress_bars()
    trl_logger.setLevel(logging.ERROR)
    os.environ["TQDM_DISABLE"] = "1"  # DPO's reference-log-prob precompute reads it
    telemetry = hub_constants.HF_HUB_DISABLE_TELEMETRY
    hub_constants.HF_HUB_DISABLE_TELEMETRY = True  # read by huggingface_hub's send_telemetry at each call
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        hub_constants.HF_HUB_DISABLE_TELEMETRY = telemetry
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
        if data_bars:
            datasets.enable_progress_bars()
        trl_logger.setLevel(trl_level)
        if tqdm_disable is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = tqdm_disable


def _train(trainer, capture: _LogCapture, save_initial_adapter: str | Path | None) -> list[dict[str, float]]:
    if save_initial_adapter is not None:
        # trl created the adapter (peft's init: A kaiming-uniform under `set_seed(seed)`, B = 0); save it before any
        # step so the meshlm side can start from the same adapter weights.
        trainer.model.save_pretrained(str(save_initial_adapter))
    trainer.train()
    return capture.logs


def _dataset(records: list[dict]):
    from datasets import Dataset

    return Dataset.from_list([dict(r) for r in records])


def sft_logs(
    model_dir: str | Path,
    records: list[dict],
    *,
    steps: int = 3,
    batch_size: int = 2,
    grad_accum: int = 1,
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    completion_only: bool = True,
    lora: Any = None,
    save_initial_adapter: str | Path | None = None,
    max_length: int | None = 1024,
    seed: int = 42,
) -> list[dict[str, float]]:
    """`trl.SFTTrainer` on `records` for `steps` optimizer steps; returns trl's log of each step (`loss`, `grad_norm`,
    `learning_rate`, `entropy`, `mean_token_accuracy`, `num_tokens`, `epoch`, `step`).

    Records are `{"prompt", "completion"}` (strings, or message lists) or `{"messages"}` (a chat, rendered with the
    folder's chat template, which must carry `{% generation %}` markers when `completion_only`), or `{"text"}`.
    `completion_only`: the loss on completion tokens only (`completion_only_loss`) for prompt/completion records, and
    on assistant tokens only (`assistant_only_loss`) for chats; False: on every token. `lora`: a `peft.LoraConfig`
    (trl wraps the model); `save_initial_adapter`: a folder to save the adapter in before the first step."""
    from trl import SFTConfig, SFTTrainer

    _check_records(records, batch_size, grad_accum)
    chat = "messages" in records[0]
    tokenizer = load_tokenizer(model_dir)
    capture = _LogCapture()
    with tempfile.TemporaryDirectory(prefix="trl-oracle-sft-") as out, _quiet():
        args = SFTConfig(
            **_common_args(
                out,
                steps=steps,
                batch_size=batch_size,
                grad_accum=grad_accum,
                lr=lr,
                weight_decay=weight_decay,
                seed=seed,
            ),
            max_length=max_length,
            packing=False,
            padding_free=False,
            completion_only_loss=completion_only if not chat else None,
            assistant_only_loss=completion_only and chat,
            shuffle_dataset=False,
            loss_type="nll",
            model_init_kwargs={"dtype": "float32"},
        )
        trainer = SFTTrainer(
            model=str(model_dir),
            args=args,
            train_dataset=_dataset(records),
            processing_class=tokenizer,
            peft_config=lora,
            callbacks=[capture],
        )
        return _train(trainer, capture, save_initial_adapter)


def sft_losses(model_dir: str | Path, records: list[dict], **kwargs: Any) -> list[float]:
    """The per-step training loss of `sft_logs` (same arguments)."""
    return [log["loss"] for log in sft_logs(model_dir, records, **kwargs)]


DPO_KEYS = (
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def dpo_metrics(
    model_dir: str | Path,
    records: list[dict],
    *,
    steps: int = 3,
    batch_size: int = 2,
    grad_accum: int = 1,
    lr: float = 1e-3,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    weight_decay: float = 0.0,
    lora: Any = None,
    save_initial_adapter: str | Path | None = None,
    precompute_ref_log_probs: bool = False,
    max_length: int | None = 1024,
    seed: int = 42,
) -> list[dict[str, float]]:
    """`trl.DPOTrainer` on `{"prompt", "chosen", "rejected"}` records (strings, or message lists rendered with the
    folder's chat template) for `steps` optimizer steps; returns trl's log of each step: at least `DPO_KEYS`, plus
    `logits/chosen`, `logits/rejected`, `entropy`, `mean_token_accuracy`, `num_tokens`, `grad_norm`, `learning_rate`.

    Full fine-tuning: the reference is a second copy of the starting model (or, with `precompute_ref_log_probs`, its
    log-probs computed once before training). `lora` (a `peft.LoraConfig`): trl wraps the model and the reference is
    the same model with the adapter disabled. `loss_type`: "sigmoid", "ipo", "hinge" (or any trl loss type).
    NB: in trl 1.16, `label_smoothing` only affects the "robust", "exo_pair", "aot" and "aot_unpaired" losses; the
    "sigmoid", "ipo" and "hinge" losses ignore it."""
    from trl import DPOConfig, DPOTrainer

    _check_records(records, batch_size, grad_accum)
    tokenizer = load_tokenizer(model_dir)
    capture = _LogCapture()
    with tempfile.TemporaryDirectory(prefix="trl-oracle-dpo-") as out, _quiet():
        args = DPOConfig(
            **_common_args(
                out,
                steps=steps,
                batch_size=batch_size,
                grad_accum=grad_accum,
                lr=lr,
                weight_decay=weight_decay,
                seed=seed,
            ),
            beta=beta,
            loss_type=[loss_type],
            label_smoothing=label_smoothing,
            max_length=max_length,
            precompute_ref_log_probs=precompute_ref_log_probs,
            padding_free=False,
            use_weighting=False,
            ld_alpha=None,
            f_divergence_type="reverse_kl",
            sync_ref_model=False,
            disable_dropout=True,
            model_init_kwargs={"dtype": "float32"},
        )
        trainer = DPOTrainer(
            model=str(model_dir),
            args=args,
            train_dataset=_dataset(records),
            processing_class=tokenizer,
            peft_config=lora,
            callbacks=[capture],
        )
        return _train(trainer, capture, save_initial_adapter)


ORPO_KEYS = (*DPO_KEYS, "nll_loss", "log_odds_ratio", "log_odds_chosen")


def orpo_metrics(
    model_dir: str | Path,
    records: list[dict],
    *,
    steps: int = 3,
    batch_size: int = 2,
    grad_accum: int = 1,
    lr: float = 1e-3,
    beta: float = 0.1,
    weight_decay: float = 0.0,
    lora: Any = None,
    save_initial_adapter: str | Path | None = None,
    max_length: int | None = 1024,
    seed: int = 42,
) -> list[dict[str, float]]:
    """`trl.experimental.orpo.ORPOTrainer` on `{"prompt", "chosen", "rejected"}` records for `steps` optimizer steps;
    returns trl's log of each step: at least `ORPO_KEYS`, plus `logits/chosen`, `logits/rejected`, `grad_norm`,
    `learning_rate`. ORPO has no reference model; `rewards/*` are beta * the mean per-token log-prob."""
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    _check_records(records, batch_size, grad_accum)
    tokenizer = load_tokenizer(model_dir)
    if tokenizer.pad_token is None:  # ORPO's collator needs one; DPO and SFT set the same themselves
        tokenizer.pad_token = tokenizer.eos_token
    capture = _LogCapture()
    with tempfile.TemporaryDirectory(prefix="trl-oracle-orpo-") as out, _quiet():
        args = ORPOConfig(
            **_common_args(
                out,
                steps=steps,
                batch_size=batch_size,
                grad_accum=grad_accum,
                lr=lr,
                weight_decay=weight_decay,
                seed=seed,
            ),
            beta=beta,
            max_length=max_length,
            disable_dropout=True,
            remove_unused_columns=False,
        )
        trainer = ORPOTrainer(
            model=load_torch_model(model_dir),
            args=args,
            train_dataset=_dataset(records),
            processing_class=tokenizer,
            peft_config=lora,
            callbacks=[capture],
        )
        return _train(trainer, capture, save_initial_adapter)


def lora_config(r: int = 4, alpha: int = 8, targets: list[str] | None = None):
    """A `peft.LoraConfig` for GPT-J (no dropout, no bias, not on `lm_head`, which trl's SFT and DPO refuse)."""
    from peft import LoraConfig

    return LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=0.0,
        bias="none",
        target_modules=targets or LORA_TARGETS,
        task_type="CAUSAL_LM",
    )


# ---------------------------------------------------------------------------------------------------------------------
# Sample records


def sft_records() -> list[dict]:
    return [
        {"prompt": "Question: What is the capital of France? Answer:", "completion": " Paris."},
        {"prompt": "The sky is", "completion": " blue and the grass is green."},
        {"prompt": "Hello! How are you?", "completion": " I am fine, thank you."},
        {"prompt": "The quick brown fox", "completion": " jumps over the lazy dog."},
        {"prompt": "What colour is the sky?", "completion": " Blue."},
        {"prompt": "Question: What is green? Answer:", "completion": " The grass."},
    ]


def chat_records() -> list[dict]:
    def chat(user, assistant, system=None):
        messages = [{"role": "system", "content": system}] if system else []
        return {"messages": [*messages, {"role": "user", "content": user}, {"role": "assistant", "content": assistant}]}

    return [
        chat("What is the capital of France?", "Paris is the capital of France."),
        chat("What colour is the sky?", "The sky is blue.", system="You are fine."),
        {
            "messages": [
                {"role": "user", "content": "Hello!"},
                {"role": "assistant", "content": "Hello! How are you?"},
                {"role": "user", "content": "I am fine, thank you."},
                {"role": "assistant", "content": "The grass is green."},
            ]
        },
        chat("The quick brown fox?", "It jumps over the lazy dog."),
    ]


def preference_records() -> list[dict]:
    return [
        {"prompt": "Question: What is the capital of France? Answer:", "chosen": " Paris.", "rejected": " The dog."},
        {"prompt": "The sky is", "chosen": " blue.", "rejected": " green and the grass is blue."},
        {"prompt": "Hello! How are you?", "chosen": " I am fine, thank you.", "rejected": " No."},
        {"prompt": "The quick brown fox", "chosen": " jumps over the lazy dog.", "rejected": " is green."},
    ]


def chat_preference_records() -> list[dict]:
    def pair(user, chosen, rejected):
        return {
            "prompt": [{"role": "user", "content": user}],
            "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}],
        }

    return [
        pair("What is the capital of France?", "Paris.", "The dog."),
        pair("What colour is the sky?", "Blue.", "Green and the grass is blue."),
        pair("Hello! How are you?", "I am fine, thank you.", "No."),
        pair("The quick brown fox?", "It jumps over the lazy dog.", "It is green."),
    ]


@dataclass
class GrpoStep:
    """What trl's GRPOTrainer made of one batch of completions: the advantages, the completion mask its loss used
    (after `mask_truncated_completions`), the loss, the gradient of the loss with respect to the supplied per-token
    log-probs (when they were supplied), and the step's metrics (trl's `_metrics["train"]`, one value each)."""

    advantages: np.ndarray  # [N]
    mask: np.ndarray  # [N, T]
    prompt_ids: np.ndarray  # [N, P] the prompts as trl tokenized them (left-padded)
    loss: float
    logps_grad: np.ndarray | None  # [N, T] d loss / d logps; None when the model computed its own log-probs
    metrics: dict[str, float]
    model: Any  # the torch model, holding the loss's gradient when it computed its own log-probs


def grpo_step(
    model_dir: str | Path,
    prompts: list[str],
    completion_ids: list[list[int]],
    rewards: np.ndarray,
    reward_names: list[str],
    *,
    reward_weights: list[float] | None = None,
    logps: np.ndarray | None = None,
    entropy: np.ndarray | None = None,
    old_logps: np.ndarray | None = None,
    ref_logps: np.ndarray | None = None,
    rows: slice = slice(None),
    **grpo: Any,
) -> GrpoStep:
    """trl's own `GRPOTrainer._generate_and_score_completions` and `_compute_loss`, run on completions, rewards and
    log-probs supplied here instead of sampled and scored: `_generate_single_turn` returns `completion_ids` (N =
    len(prompts) * num_generations of them, grouped by prompt), `_calculate_rewards` returns `rewards` [N, F] (NaN
    for trl's None), and `_get_per_token_logps_and_entropies` returns `old_logps` (computed by trl only when
    num_iterations > 1) and `ref_logps` (beta > 0) [N, T], and the policy's `logps` and `entropy` [N, T] with
    `logps` as a leaf whose gradient comes back. Without `logps`, the model computes its own (trl's fused LM head at
    `temperature`) and holds the loss's gradient. `grpo`: GRPOConfig's settings (num_generations,
    max_completion_length, beta, loss_type, ...). One process, no gradient accumulation. The loss is of `rows` of
    the generation batch: one optimizer step's share when `steps_per_generation` splits it (the advantages and
    reward metrics are of the whole batch, as trl computes them before splitting)."""
    from trl import GRPOConfig, GRPOTrainer

    def reward_function(name: str):
        def score(prompts, completions, **kwargs):
            raise AssertionError("the rewards are supplied")

        score.__name__ = name
        return score

    n = len(completion_ids)
    tokenizer = load_tokenizer(model_dir)
    with tempfile.TemporaryDirectory(prefix="trl-oracle-grpo-") as out, _quiet():
        common = _common_args(out, steps=1, batch_size=n, grad_accum=1, lr=0.0, weight_decay=0.0, seed=0)
        common.pop("dataset_num_proc")  # GRPOConfig has none: it tokenizes prompts as it samples
        args = GRPOConfig(
            **common,
            reward_weights=reward_weights,
            **grpo,
        )
        trainer = GRPOTrainer(
            model=load_torch_model(model_dir),
            reward_funcs=[reward_function(name) for name in reward_names],
            args=args,
            train_dataset=_dataset([{"prompt": p} for p in prompts]),
            processing_class=tokenizer,
        )

        def tensor(values: Any) -> torch.Tensor:
            return torch.tensor(np.asarray(values), dtype=torch.float32)

        policy = None if logps is None else tensor(logps).requires_grad_(True)
        forward = trainer._get_per_token_logps_and_entropies

        def per_token_logps(model, *args, compute_entropy=False, **kwargs):
            if model is trainer.ref_model:
                return tensor(ref_logps), None, None
            if not compute_entropy:  # the log-probs the completions were sampled with (num_iterations > 1)
                return tensor(old_logps), None, None
            if policy is None:
                return forward(model, *args, compute_entropy=True, **kwargs)
            return policy[rows], tensor(entropy)[rows], None

        trainer._generate_single_turn = lambda *args, **kwargs: (completion_ids, None)
        trainer._calculate_rewards = lambda *args: tensor(rewards)
        trainer._get_per_token_logps_and_entropies = per_token_logps
        trainer.current_gradient_accumulation_steps = 1
        trainer.model.train()
        group = len(completion_ids) // len(prompts)
        batch = trainer._generate_and_score_completions([{"prompt": p} for p in prompts for _ in range(group)])
        step = {key: value[rows] if key != "num_items_in_batch" else value for key, value in batch.items()}
        loss = trainer._compute_loss(trainer.model, step)
        loss.backward()
        return GrpoStep(
            advantages=batch["advantages"].numpy(),
            mask=batch["completion_mask"].numpy(),
            prompt_ids=batch["prompt_ids"].numpy(),
            loss=loss.item(),
            logps_grad=None if policy is None else policy.grad.numpy(),
            metrics={key: values[-1] for key, values in trainer._metrics["train"].items()},
            model=trainer.model,
        )


def dump(logs: list[dict[str, float]]) -> str:
    return json.dumps(logs, indent=1, default=float)
