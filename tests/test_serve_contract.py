"""The serving wing's host side imports no jax: the scheduler and the contract it shares with the runner
(`batch`, `params`, `outputs`, `pages`) run without a device."""

import subprocess
import sys

HOST_ONLY = ["scheduler", "batch", "params", "outputs", "pages"]


def test_the_scheduler_and_the_contract_import_no_jax():
    imports = "; ".join(f"import meshlm.serve.{m}" for m in HOST_ONLY)
    code = f"import sys; {imports}; print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
