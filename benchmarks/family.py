"""The GPT-J family at one shape, for the meshlm-vs-transformers benchmarks (`--arch gptj|neox|neo`).

Each architecture keeps its own choices (residual form, norms, rotary style, positions, local attention,
biases, tied head, activation: those of its presets) at the sizes of the GPT-J runs, so the figures of
the three compare like with like; the transformers peer is that architecture's own class.
"""

from __future__ import annotations

from typing import Any

from meshlm.config import ModelConfig, preset
from meshlm.formats import hf

# The preset whose architecture each --arch takes (its sizes are replaced).
ARCHS = {"gptj": "gptj-6b", "neox": "pythia-6.9b", "neo": "gpt-neo-125m"}
SIZES = ("n_layer", "d_model", "n_head", "d_ff", "vocab_size", "n_vocab_used", "max_seq_len")


def shaped_as(arch: str, shape: ModelConfig) -> ModelConfig:
    """`arch`'s architecture at `shape`'s sizes. Rotary covers what it covers in the family's models:
    GPT-J keeps `shape`'s rotary_dim, GPT-NeoX (Pythia) a quarter of each head, GPT-Neo nothing."""
    rotary_dim = {"gptj": shape.rotary_dim, "neox": shape.d_head // 4, "neo": 0}[arch]
    return preset(ARCHS[arch]).replace(**{k: getattr(shape, k) for k in SIZES}, rotary_dim=rotary_dim)


def torch_model(cfg: ModelConfig) -> Any:
    """The transformers peer, randomly initialised: the class and config.json that `meshlm convert --to hf`
    writes for `cfg` (GPTJForCausalLM, GPTNeoXForCausalLM or GPTNeoForCausalLM)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    values = hf.to_hf_config(cfg)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(values.pop("model_type"), **values))
