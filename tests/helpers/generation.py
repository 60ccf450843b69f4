"""Greedy generation on both sides of an oracle comparison: meshlm's settings and transformers' loop."""

import numpy as np
import torch

from meshlm.serve.params import SamplingParams

NEW = 40  # tokens generated in the oracle comparisons


def hf_greedy(hf_model, prompt: list[int], new: int, **kwargs) -> tuple[list[int], np.ndarray]:
    """transformers' greedy generate of one unpadded prompt: the new tokens and the raw logits of each step."""
    with torch.no_grad():
        out = hf_model.torch_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
            **kwargs,
        )
    logits = torch.stack(out.logits, 1)[0].float().numpy()
    return out.sequences[0, len(prompt) :].tolist(), logits


def greedy(max_new: int = NEW, **changes) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, temperature=0.0, **changes)
