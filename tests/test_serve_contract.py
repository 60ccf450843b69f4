"""The serving wing's host side imports no jax: the scheduler and the contract it shares with the runner
(`batch`, `params`, `outputs`, `pages`) run without a device. And the wing's deprecated re-exports still answer,
with a warning."""

import importlib
import subprocess
import sys
import warnings

import pytest

import meshlm.generate
import meshlm.grammar

HOST_ONLY = ["scheduler", "batch", "params", "outputs", "pages"]


def test_the_scheduler_and_the_contract_import_no_jax():
    imports = "; ".join(f"import meshlm.serve.{m}" for m in HOST_ONLY)
    code = f"import sys; {imports}; print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("old", "name", "new"),
    [
        ("meshlm.generate", "SamplingParams", "meshlm.serve.params"),
        ("meshlm.generate", "RowOutput", "meshlm.serve.outputs"),
        ("meshlm.generate", "settings_for", "meshlm.serve.batch"),
        ("meshlm.grammar", "Constraint", "meshlm.serve.grammar"),
    ],
)
def test_deprecated_imports_warn_and_give_the_same_object(old, name, new):
    old_module, new_module = importlib.import_module(old), importlib.import_module(new)
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        got = getattr(old_module, name)
    assert got is getattr(new_module, name)


def test_a_name_the_old_module_never_had_is_an_attribute_error():
    with warnings.catch_warnings(), pytest.raises(AttributeError):
        warnings.simplefilter("error")
        meshlm.generate.no_such_name  # noqa: B018
