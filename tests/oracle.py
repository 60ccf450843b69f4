"""The independent references: transformers' GPT-J family models (torch, CPU) with random weights."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import (
    AutoModelForCausalLM,
    CodeGenConfig,
    CodeGenForCausalLM,
    GPTJConfig,
    GPTJForCausalLM,
    GPTNeoConfig,
    GPTNeoForCausalLM,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    PreTrainedModel,
)

# model_type -> (config class, model class)
CLASSES = {
    "gptj": (GPTJConfig, GPTJForCausalLM),
    "gpt_neox": (GPTNeoXConfig, GPTNeoXForCausalLM),
    "gpt_neo": (GPTNeoConfig, GPTNeoForCausalLM),
    "codegen": (CodeGenConfig, CodeGenForCausalLM),
}


@dataclass
class HFModel:
    path: Path
    torch_model: PreTrainedModel

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return self.torch_model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


def random_model(model_type: str = "gptj", seed: int = 0, std: float = 0.2, **config) -> PreTrainedModel:
    """A model of `model_type` with every weight drawn at random (biases and norms too, so no mapping
    hides behind a zero or a one)."""
    config_class, model_class = CLASSES[model_type]
    torch.manual_seed(seed)
    config.setdefault("bos_token_id", 0)
    config.setdefault("eos_token_id", 0)
    m = model_class(config_class(**config)).eval()
    norms = {name for name, module in m.named_modules() if isinstance(module, torch.nn.LayerNorm)}
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.normal_(1.0 if name.removesuffix(".weight") in norms else 0.0, std)
    return m


def random_gptj(seed: int = 0, std: float = 0.2, **config) -> GPTJForCausalLM:
    return random_model("gptj", seed, std, **config)


def make_hf_model(
    folder: Path, seed: int = 0, safe_serialization: bool = True, model_type: str = "gptj", **config
) -> HFModel:
    m = random_model(model_type, seed=seed, **config)
    if safe_serialization:
        m.save_pretrained(folder)
    else:  # the legacy pickle layout, which transformers no longer writes itself
        m.config.save_pretrained(folder)
        torch.save(m.state_dict(), Path(folder) / "pytorch_model.bin")
    return HFModel(Path(folder), m)


def load_hf(folder: Path) -> PreTrainedModel:
    """A folder meshlm wrote, as transformers loads it (whichever architecture its config.json names)."""
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def open_hf(folder: Path) -> HFModel:
    """A folder meshlm wrote, as transformers loads it."""
    return HFModel(folder, load_hf(folder))
