"""Deprecated: `meshlm.generate` split into the serving wing by role, and goes in the next release. Import
`SamplingParams` from `meshlm.serve.params`, `Completion` and `RowOutput` from `meshlm.serve.outputs`, the
batch types (`Settings`, `Step`) from `meshlm.serve.batch` and the sampler's functions from
`meshlm.serve.sampler`. Each name read from here still works, with a DeprecationWarning naming its new home."""

from __future__ import annotations

import importlib
import warnings

_HOMES = {
    "meshlm.serve.params": "MAX_STOP_IDS MAX_LOGIT_BIAS TOP_LOGPROBS check_chunk check_token_ids SamplingParams",
    "meshlm.serve.batch": "Settings Step seed_word settings_for bitmask_words",
    "meshlm.serve.outputs": "Completion RowOutput",
    "meshlm.serve.sampler": (
        "repetition_penalty apply_logit_bias frequency_presence_penalty apply_temperature CANDIDATES top_k_filter "
        "top_p_filter min_p_filter filter_logits argmax sample draw used_vocabulary row_keys penalize distribution "
        "choose unpack_bitmask"
    ),
}
_HOME = {name: module for module, names in _HOMES.items() for name in names.split()}


def __getattr__(name: str) -> object:
    if name not in _HOME:
        raise AttributeError(f"module 'meshlm.generate' has no attribute {name!r}")
    warnings.warn(f"meshlm.generate is deprecated: import {name} from {_HOME[name]}", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(_HOME[name]), name)
