"""benchmarks/decode_rows.py with the TPU paged kernel forced for every global decode step (FORCE_PAGED=1),
whatever the head size or pool dtype: meshlm.attention.resolve wrapped in this process only (no file changed)."""
import os
import runpy
import sys

import meshlm.attention as A
import meshlm.model as M

original = A.resolve


def forced(**kw):
    k = original(**kw)
    if os.environ.get("FORCE_PAGED") == "1" and kw["phase"] == "decode" and kw.get("impl", "auto") == "auto" \
            and kw["kind"] == "global" and not kw.get("biased") and k.name == "xla":
        return A.Kernel("paged_tpu", "forced by .tpu/forced.py (was: " + k.reason + ")")
    return k


A.resolve = M.resolve = forced
sys.argv = ["benchmarks/decode_rows.py", *sys.argv[1:]]
runpy.run_path("benchmarks/decode_rows.py", run_name="__main__")
