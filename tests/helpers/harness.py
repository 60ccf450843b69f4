"""lm-evaluation-harness run offline on the suite's own YAML tasks."""

import contextlib
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[2]
TASK_DIR = ROOT / "tests" / "lm_eval_tasks"
TASKS = ["meshlm_test_mc", "meshlm_test_lambada", "meshlm_test_wikitext", "meshlm_test_gen"]
CONTEXT = 128  # shorter than the longest task documents, so truncation and rolling windows are exercised


@contextlib.contextmanager
def in_repo_root():
    """The task YAMLs name their data files relative to the repository root, as lm-eval reads them."""
    before = os.getcwd()
    os.chdir(ROOT)
    try:
        yield
    finally:
        os.chdir(before)


def harness(model: str, model_args: str, batch_size: int, tasks: list[str] = TASKS) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    with in_repo_root():
        return lm_eval.simple_evaluate(
            model=model,
            model_args=model_args,
            tasks=tasks,
            batch_size=batch_size,
            device="cpu",
            task_manager=TaskManager(include_path=str(TASK_DIR), include_defaults=False),
            log_samples=True,
            bootstrap_iters=0,
        )


def responses(results: dict, task: str) -> list:
    return [s["resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def unwrap(response: Any) -> Any:
    """One request's response: lm-eval wraps some in a one-element list."""
    return response[0] if isinstance(response, list | tuple) and len(response) == 1 else response
