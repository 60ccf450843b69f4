"""LoRA adapters made by `peft` itself, the oracle of meshlm's adapters."""

from pathlib import Path

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model

from tests import oracle
from tests.helpers.family import ARCHS as FAMILY

VOCAB = 256
ARCHS = {
    "gptj": dict(model_type="gptj", n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=64, vocab_size=VOCAB),
    "neox": FAMILY["neox-parallel"],
    "neo": FAMILY["gpt-neo"],
    "codegen": FAMILY["codegen"],
}

# Every projection of each architecture, by its transformers module name.
TARGETS = {
    "gptj": ["q_proj", "k_proj", "v_proj", "out_proj", "fc_in", "fc_out"],
    "neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
    "neo": ["q_proj", "k_proj", "v_proj", "out_proj", "c_fc", "c_proj"],
    "codegen": ["qkv_proj", "out_proj", "fc_in", "fc_out"],
}


def peft_model(base: Path, arch: str, seed: int = 0, **settings) -> PeftModel:
    """`peft` on a fresh copy of the base, with A and B both random (so the adapter changes the output)."""
    torch.manual_seed(seed)
    settings = {"r": 4, "lora_alpha": 12, "target_modules": TARGETS[arch], "init_lora_weights": False, **settings}
    return get_peft_model(oracle.load_hf(base), PeftLoraConfig(**settings)).eval()
