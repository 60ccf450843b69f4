"""Deprecated: output constraints moved to `meshlm.serve.grammar`, and this module goes in the next release.
Each name read from here still works, with a DeprecationWarning."""

from __future__ import annotations

import warnings

from meshlm.serve import grammar as _grammar


def __getattr__(name: str) -> object:
    if name.startswith("__"):
        raise AttributeError(name)
    value = getattr(_grammar, name)
    warnings.warn(f"meshlm.grammar is deprecated: import {name} from meshlm.serve.grammar", DeprecationWarning,
                  stacklevel=2)  # fmt: skip
    return value
