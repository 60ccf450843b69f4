"""Evaluation: meshlm as an lm-evaluation-harness model (`meshlm`), and sliding-window perplexity.

lm-eval 0.4 finds models in its own registry and has no plugin discovery, so importing this module is
what registers `meshlm`: `meshlm eval`, `evaluate_tasks` and the `meshlm-lm-eval` command import it
before calling the harness. Scoring runs through `LanguageModel.token_logprobs`: the LM head, log-softmax
and gather run on the devices at the scored positions only; requests are sorted by length and padded to
a few length buckets with a fixed batch, so a whole evaluation compiles only a handful of shapes.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import multiprocessing
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm.auto import tqdm

from meshlm import corpus
from meshlm.api import SEQ_BUCKET, LanguageModel, load
from meshlm.config import ConfigError, InputError
from meshlm.serve.params import SamplingParams
from meshlm.sharding import MESH_AXES, batch_ways
from meshlm.tokenizer import Tokenizer, TokenizerSpec, load_tokenizer

DEFAULT_BATCH_SIZE = 16
SCORE_BUCKET = 16  # continuations up to this many tokens are scored through one [batch, 16] LM-head call

Pair = tuple[list[int], list[int]]  # (context tokens, continuation tokens)


def length_bucket(n: int, context: int) -> int:
    """The padded length for a row of `n` tokens: 64, 128, 192, 256, 384, 512, 768, ... (multiples of
    SEQ_BUCKET, at most 1.5x padding, a dozen shapes up to 2048), capped at `context`."""
    bucket = SEQ_BUCKET
    while bucket < n:
        bucket += max(SEQ_BUCKET, 1 << (bucket.bit_length() - 2))
    return min(bucket, context)


def score_pairs(
    lm: LanguageModel,
    pairs: Sequence[Pair],
    batch_size: int = DEFAULT_BATCH_SIZE,
    desc: str = "loglikelihood",
    disable_tqdm: bool = False,
    max_length: int | None = None,
) -> list[tuple[float, bool]]:
    """For each (context, continuation): sum of log p(continuation | context), and whether greedy decoding
    reproduces the continuation. Contexts are cut from the left so each row is at most `max_length`
    (default: the model's context) inputs."""
    context = max_length or lm.config.max_seq_len
    ways = batch_ways(lm.mesh)
    batch_size = -(-max(1, batch_size) // ways) * ways
    for ctx, cont in pairs:
        if not ctx or not cont:
            raise InputError("every request needs a non-empty context and continuation")
        if len(cont) > context:
            raise InputError(f"a continuation of {len(cont)} tokens does not fit the model's context ({context})")
    rows = [(ctx + cont)[-(context + 1) :] for ctx, cont in pairs]
    order = sorted(range(len(pairs)), key=lambda i: -len(rows[i]))
    results: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
    with tqdm(total=len(pairs), desc=desc, disable=disable_tqdm) as bar:
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            length = length_bucket(len(rows[chunk[0]]) - 1, context)
            longest = max(len(pairs[i][1]) for i in chunk)
            k = min(SCORE_BUCKET if longest <= SCORE_BUCKET else length_bucket(longest, context), length)
            tokens = np.zeros((batch_size, length), np.int32)
            targets = np.zeros((batch_size, k), np.int32)
            at = np.zeros((batch_size, k), np.int32)
            for r, i in enumerate(chunk):
                n, cont = len(rows[i]) - 1, pairs[i][1]
                tokens[r, :n] = rows[i][:-1]
                targets[r, : len(cont)] = cont
                at[r, : len(cont)] = np.arange(n - len(cont), n)
            logprobs, argmax = lm.token_logprobs(tokens, targets, at)
            for r, i in enumerate(chunk):
                c = len(pairs[i][1])
                greedy = bool((argmax[r, :c] == targets[r, :c]).all())
                results[i] = (float(logprobs[r, :c].sum(dtype=np.float64)), greedy)
            bar.update(len(chunk))
    return results


def rolling_windows(tokens: list[int], prefix: int, context: int, stride: int | None = None) -> list[Pair]:
    """Disjoint (context, continuation) windows that score every token once, each with as much context as
    fits, as lm-eval defines them; `stride` < context makes later windows overlap (each scores `stride`
    new tokens after `context - stride` tokens of left context)."""
    stride = context if stride is None else stride
    if not 1 <= stride <= context:
        raise InputError(f"stride must lie in [1, {context}] (the model's context), got {stride}")
    windows = get_rolling_token_windows(
        tokens, prefix_token=prefix, max_seq_len=context, context_len=context - stride + 1
    )
    return [make_disjoint_window(w) for w in windows]


def mesh_spec(mesh: str | None, **axes: int) -> str | None:
    """Rebuild a mesh spec that lm-eval's comma-split model_args scattered: "mesh=data=2,fsdp=2,model=2"
    arrives as mesh="data=2", fsdp=2, model=2. ";" also separates axes ("mesh=data=2;model=4")."""
    unknown = sorted(set(axes) - set(MESH_AXES))
    if unknown:
        raise ConfigError(f"meshlm model_args: unknown argument(s) {unknown}")
    parts = [p for p in (mesh or "").replace(";", ",").split(",") if p] + [f"{a}={n}" for a, n in axes.items()]
    return ",".join(parts) or None


@register_model("meshlm")
class MeshLM(TemplateLM):
    """lm-eval model backed by a meshlm `LanguageModel` on any mesh.

    model_args: pretrained (checkpoint folder, or a loaded LanguageModel from Python), mesh (a spec such as
    "data=2,fsdp=2,model=2", which works inside lm-eval's comma-separated model_args too), dtype,
    batch_size, max_length (defaults to the model's context), max_gen_toks, tokenizer (a tokenizer.json or
    .tiktoken file, or a model folder; default: the model's own, as `LanguageModel.tokenizer`), adapter
    (a LoRA adapter: a PEFT folder or a meshlm LoRA run) and quantize ("int8", "w8a8" or "nf4"), as `meshlm.load`.
    """

    def __init__(
        self,
        pretrained: str | Path | LanguageModel,
        mesh: str | None = None,
        dtype: str = "float32",
        batch_size: int | str | None = None,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        tokenizer: TokenizerSpec = None,
        device: str | None = None,
        max_batch_size: int | None = None,
        seed: int = 1234,
        adapter: str | None = None,
        quantize: str | None = None,
        **mesh_axes: int,
    ):
        super().__init__()
        del device, max_batch_size  # placement comes from `mesh`; the batch is fixed so shapes compile once
        if isinstance(pretrained, LanguageModel):
            self.lm = pretrained
        else:
            mesh = mesh_spec(mesh, **mesh_axes)
            self.lm = load(pretrained, mesh=mesh, dtype=dtype, adapter=adapter, quantize=quantize)
        self.tokenizer = self.lm.tokenizer if tokenizer is None else load_tokenizer(tokenizer)
        if isinstance(batch_size, str):
            batch_size = None if batch_size.startswith("auto") else int(batch_size)
        self.batch_size = int(batch_size or DEFAULT_BATCH_SIZE)
        context = self.lm.config.max_seq_len
        self.max_length = int(max_length or context)
        if not 1 <= self.max_length <= context:
            raise ConfigError(f"meshlm: max_length must lie in [1, {context}] (the model's context)")
        self.max_gen_toks = int(max_gen_toks)
        self.seed = int(seed)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eot_id

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.tokenizer.encode(string)

    def tok_decode(self, tokens: Iterable[int]) -> str:
        return self.tokenizer.decode(list(tokens))

    def _loglikelihood_tokens(
        self, requests: list[tuple[tuple[str, str], list[int], list[int]]], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        results = self._score([(ctx, cont) for _, ctx, cont in requests], "loglikelihood requests", disable_tqdm)
        for (key, _, _), answer in zip(requests, results, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def _score(self, pairs: Sequence[Pair], desc: str, disable_tqdm: bool) -> list[tuple[float, bool]]:
        disable = disable_tqdm or self.rank != 0
        return score_pairs(self.lm, pairs, self.batch_size, desc, disable, max_length=self.max_length)

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        texts = [req.args[0] for req in requests]
        windows, owners = [], []
        for i, text in enumerate(texts):
            for window in rolling_windows(self.tok_encode(text), self.prefix_token_id, self.max_length):
                windows.append(window)
                owners.append(i)
        totals = [0.0] * len(texts)
        for i, (logprob, _) in zip(owners, self._score(windows, "rolling windows", disable_tqdm), strict=True):
            totals[i] += logprob
        for text, total in zip(texts, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Batched generation per distinct gen_kwargs; stop sequences (and end-of-text) cut the output."""
        results: list[str] = [""] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        eos = self.tok_decode([self.eot_token_id])
        with tqdm(total=len(requests), desc="generate_until requests", disable=disable_tqdm or self.rank != 0) as bar:
            for indices in groups.values():
                kwargs = normalize_gen_kwargs(dict(requests[indices[0]].args[1]), self.max_gen_toks)
                until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
                max_new = int(kwargs.pop("max_gen_toks"))
                if max_new >= self.max_length:
                    raise InputError(f"max_gen_toks ({max_new}) must be below the context ({self.max_length})")
                sampling = self._sampling(kwargs, max_new, until)
                for start in range(0, len(indices), self.batch_size):
                    chunk = indices[start : start + self.batch_size]
                    prompts = [self._fit_prompt(requests[i].args[0], self.max_length - max_new) for i in chunk]
                    tokens = [self.tok_encode(p) or [self.eot_token_id] for p in prompts]
                    outputs = self.lm.generate_tokens(tokens, [sampling] * len(tokens))
                    for i, out in zip(chunk, outputs, strict=True):
                        results[i] = postprocess_generated_text(out.text or "", until, None)
                        self.cache_hook.add_partial("generate_until", requests[i].args, results[i])
                    bar.update(len(chunk))
        return results

    def _sampling(self, kwargs: dict[str, Any], max_new: int, until: Sequence[str]) -> SamplingParams:
        """The harness's generation kwargs as meshlm sampling settings (greedy unless do_sample)."""
        sample = bool(kwargs.get("do_sample")) and float(kwargs.get("temperature", 1.0)) > 0
        return self.lm.sampling(
            max_new_tokens=max_new,
            temperature=float(kwargs.get("temperature", 1.0)) if sample else 0.0,
            top_k=int(kwargs.get("top_k") or 0) if sample else 0,
            top_p=float(kwargs.get("top_p") or 1.0) if sample else 1.0,
            stop=tuple(s for s in until if s),
            # eot alone, not the model's other EOS ids: lm-eval's HF backend stops at the tokenizer's EOS only
            stop_token_ids=(self.eot_token_id,),
            ignore_eos=True,
            seed=self.seed,
        )

    def _fit_prompt(self, prompt: str, budget: int) -> str:
        """The prompt, cut from the left to `budget` tokens when it is longer."""
        tokens = self.tok_encode(prompt)
        return prompt if len(tokens) <= budget else self.tok_decode(tokens[-budget:])


@functools.cache
def _indexed(include_path: str | None, defaults: bool) -> Any:
    """lm-eval's TaskManager over `include_path` (and its built-in tasks where `defaults`), indexed once a process."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=defaults)


def task_manager(include_path: str | None, tasks: tuple[str, ...]) -> Any:
    """An lm-eval TaskManager that knows `tasks`. Indexing lm-eval's ~15,000 built-in task files takes about
    20 s, so when `include_path` alone holds every task, only it is indexed; indexes are reused, a refusal's too."""
    if include_path:
        local = _indexed(include_path, False)
        if all(t in local.all_tasks for t in tasks):
            return local
    manager = _indexed(include_path, True)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ConfigError(f"unknown lm-eval task(s) {unknown}; `lm_eval ls tasks` lists them (or pass --include-path)")
    return manager


def check_tasks(tasks: Sequence[str], include_path: str | Path | None = None) -> Any:
    """Refuse an empty or unknown task list in one line naming the tasks (before any model is loaded, where
    the caller checks first); returns the TaskManager that knows them (`task_manager`)."""
    if not tasks:
        raise ConfigError("no tasks given; name lm-eval tasks such as lambada_openai,piqa")
    return task_manager(str(include_path) if include_path else None, tuple(tasks))


def run_tasks(
    lm: LanguageModel | MeshLM,
    tasks: Sequence[str],
    *,
    num_fewshot: int | None = None,
    limit: int | float | None = None,
    include_path: str | Path | None = None,
    log_samples: bool = False,
    bootstrap_iters: int = 100_000,
    **model_args: Any,
) -> dict[str, Any]:
    """Run lm-eval tasks on `lm` and return the harness's full results dict (what its CLI writes as JSON).
    `model_args` (batch_size, tokenizer, max_length, ...) go to `MeshLM` when `lm` is a LanguageModel."""
    import lm_eval

    tasks = tuple(tasks)
    manager = check_tasks(tasks, include_path)
    model = lm if isinstance(lm, MeshLM) else MeshLM(lm, **model_args)
    with _pools_without_fork():
        return lm_eval.simple_evaluate(
            model=model,
            tasks=list(tasks),
            num_fewshot=num_fewshot,
            limit=limit,
            task_manager=manager,
            log_samples=log_samples,
            bootstrap_iters=bootstrap_iters,
        )


@contextlib.contextmanager
def _pools_without_fork() -> Iterator[None]:
    """lm-eval bootstraps standard errors in a multiprocessing pool; forking a process that runs JAX's
    threads can deadlock, so its workers start from a fork server instead."""
    previous = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method("forkserver", force=True)
    try:
        yield
    finally:
        multiprocessing.set_start_method(previous, force=True)


def flatten_metrics(results: dict[str, Any]) -> dict[str, float]:
    """{"task/metric": value} from a harness results dict; the filter name is kept when it is not "none"."""
    flat = {}
    for task, values in results["results"].items():
        metrics = results.get("higher_is_better", {}).get(task, {})
        for key, value in values.items():
            metric, _, flt = key.partition(",")
            if metric in metrics and isinstance(value, int | float) and not isinstance(value, bool):
                flat[f"{task}/{metric}" + ("" if flt in ("", "none") else f"/{flt}")] = float(value)
    return flat


def evaluate_tasks(lm: LanguageModel | MeshLM, tasks: Sequence[str], **kwargs: Any) -> dict[str, float]:
    """Harness metrics for `lm` as a flat {"task/metric": value} dict, for logging during training.
    Keyword arguments are those of `run_tasks`; standard errors are skipped (`bootstrap_iters=0`):
    a training log records the metrics only."""
    kwargs.setdefault("bootstrap_iters", 0)
    return flatten_metrics(run_tasks(lm, tasks, **kwargs))


def read_documents(path: str | Path, text_field: str = "text") -> list[str]:
    """Documents to score, read as `meshlm prepare` reads text: a text file is one document, each record of a
    .jsonl / .jsonl.zst / .parquet file one document (its `text_field`), a directory all of its files in order."""
    docs, pieces = [], []
    for file, kind in corpus.expand([path]):
        if kind == "tfrecord":
            raise ConfigError(f"{file}: TFRecords hold token ids, not text; perplexity needs the text")
        if kind != "text":  # a record file: each record's text
            for where, record in corpus.records(file, kind, progress=lambda _: None):
                corpus.check_record(where, record, "text", True, text_field)
                docs.append(record[text_field])
            continue
        for piece, last in corpus.documents(file, kind, text_field, progress=lambda _: None):
            pieces.append(piece)
            if last:
                docs.append("".join(pieces))
                pieces = []
    return docs


def perplexity(
    lm: LanguageModel,
    documents: Sequence[str],
    tokenizer: Tokenizer | None = None,
    stride: int | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    disable_tqdm: bool = False,
) -> dict[str, float]:
    """Token-level perplexity exp(mean NLL) over `documents`, each scored on its own after an end-of-text
    token, with sliding windows of the model's context that advance by `stride` tokens (default: the
    whole context, i.e. disjoint windows). `tokenizer` defaults to the model's own."""
    tokenizer = tokenizer or lm.tokenizer
    context = lm.config.max_seq_len
    windows = [
        window
        for doc in documents
        for window in rolling_windows(tokenizer.encode(doc), tokenizer.eot_id, context, stride)
    ]
    if not windows:
        raise ConfigError("nothing to score: the documents contain no tokens")
    scores = score_pairs(lm, windows, batch_size, "perplexity windows", disable_tqdm)
    n_tokens = sum(len(cont) for _, cont in windows)
    nll = -sum(logprob for logprob, _ in scores) / n_tokens
    return {"perplexity": math.exp(nll), "nll": nll, "tokens": n_tokens, "documents": len(documents)}


def lm_eval_main() -> None:
    """lm-eval's own command line with the `meshlm` model registered (`meshlm-lm-eval --model meshlm ...`)."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
