"""The independent reference: `transformers.GPTJForCausalLM` (torch, CPU) with random weights."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import GPTJConfig, GPTJForCausalLM


@dataclass
class HFModel:
    path: Path
    torch_model: GPTJForCausalLM

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return self.torch_model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


def random_gptj(seed: int = 0, std: float = 0.2, **config) -> GPTJForCausalLM:
    """A GPT-J with every weight drawn at random (biases and norms too, so no mapping hides behind a zero)."""
    torch.manual_seed(seed)
    config.setdefault("bos_token_id", 0)
    config.setdefault("eos_token_id", 0)
    m = GPTJForCausalLM(GPTJConfig(**config)).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.normal_(1.0 if name.endswith("ln_1.weight") or name.endswith("ln_f.weight") else 0.0, std)
    return m


def make_hf_model(folder: Path, seed: int = 0, safe_serialization: bool = True, **config) -> HFModel:
    m = random_gptj(seed=seed, **config)
    if safe_serialization:
        m.save_pretrained(folder)
    else:  # the legacy pickle layout, which transformers no longer writes itself
        m.config.save_pretrained(folder)
        torch.save(m.state_dict(), Path(folder) / "pytorch_model.bin")
    return HFModel(Path(folder), m)


def load_hf(folder: Path) -> GPTJForCausalLM:
    return GPTJForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()


def open_hf(folder: Path) -> HFModel:
    """A folder meshlm wrote, as transformers loads it."""
    return HFModel(folder, load_hf(folder))
