"""`EngineConfig`: an engine's settings, one frozen object validated once, that `meshlm serve`, `meshlm plan
--serve`, `LanguageModel.engine` and the engine itself (with its runner) all take, so what a plan counted and
what a server runs cannot drift apart. Host-only: it imports no jax."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from meshlm.config import ATTENTION_IMPLS, InputError, dtype_of

PAGE_SIZE = 16  # tokens per KV page, where the backend has no size of its own
# prompt tokens one engine step prefills at most, by default (vLLM's max_num_batched_tokens for prompts); also
# the most rows x prompt bucket one prefill call of several rows takes (`batch.Shapes.prefill_shapes`)
PREFILL_TOKENS = 2048
# The TPU paged kernel DMAs a page per head at a time: gptj-1b's decode step at 64 rows of 512 tokens on a v5e
# took 46.3 ms with pages of 16, 25.0 of 64 and 17.9 of 128 (benchmarks/decode_rows.py, BENCHMARKS.md)
BACKEND_PAGE_SIZES = {"tpu": 128}
SPECULATE_TOKENS = 4  # tokens proposed per row and step with speculative decoding
# each integer setting's least value (None, where allowed, means "the default the engine works out"); a row
# holds at least a prompt's token and a new one
LEAST = {"max_batch": 1, "max_len": 2, "kv_tokens": 1, "page_size": 1, "ngram": 0, "speculate": 1,
         "max_adapters": 0, "max_lora_rank": 1, "chunk": 1, "max_queue": 1, "prefill_tokens": 1}  # fmt: skip


MIXED_NEEDS = {"speculating": "mixed_steps needs speculation (ngram, a draft model) off",
               "batch axes": "mixed_steps needs a mesh without batch axes (data, fsdp)"}  # fmt: skip


def check_prefill_tokens(prefill_tokens: int, page_size: int) -> None:
    """A step's prompt tokens hold at least a page: a prompt is prefilled in whole pages."""
    if prefill_tokens < page_size:
        raise InputError(f"prefill_tokens ({prefill_tokens}) must hold a KV page ({page_size} tokens)",
                         param="prefill_tokens")  # fmt: skip


@dataclass(frozen=True)
class EngineConfig:
    """How an engine batches, caches and speculates, for any model on any mesh.

    `max_batch` rows decode together over a paged KV pool of `kv_tokens` tokens (None: what fits beside the
    weights and the slots) in pages of `page_size` (None: the backend's, `tokens_per_page`); a row's prompt
    plus output is at most `max_len` tokens (None: the model's context). `prefix_caching` shares the pages of
    common prompt prefixes. `ngram` > 0 speculates `speculate` tokens a step by prompt lookup (a draft model,
    given to the engine, does too). LoRA adapters run in `max_adapters` device slots (None: one per adapter
    given) of rank `max_lora_rank` (None: the largest given). A loop thread (a server's) decodes `chunk` tokens
    per device call with at most `max_queue` rows waiting. An engine step prefills at most `prefill_tokens` prompt
    tokens: a longer prompt is prefilled a chunk a step (whole pages, at most that many tokens), the running rows
    decoding between its chunks, so that prompts stall them for no longer than that many tokens' prefill a step (a
    scored prompt, which runs whole, excepted). `mixed_steps` runs each of a step's one-row prefill calls together
    with one of its decode tokens of the running rows, the weights read once for both (None: on a TPU whose paged
    kernel reads the decode rows' pool in place in every layer; never with speculation nor on a mesh with batch axes).
    `kv_cache_dtype` ("int8": half a bfloat16 pool's bytes; None: the compute dtype) and `attention` (None: the
    model's own choice) are vLLM's options of those names."""

    max_batch: int = 8
    max_len: int | None = None
    kv_tokens: int | None = None
    page_size: int | None = None
    prefix_caching: bool = True
    ngram: int = 0
    speculate: int = SPECULATE_TOKENS
    max_adapters: int | None = None
    max_lora_rank: int | None = None
    chunk: int = 4
    max_queue: int = 64
    prefill_tokens: int = PREFILL_TOKENS
    mixed_steps: bool | None = None
    kv_cache_dtype: str | None = None
    attention: str | None = None

    def __post_init__(self) -> None:
        for name, least in LEAST.items():
            value = getattr(self, name)
            optional = self.__dataclass_fields__[name].default is None
            if optional and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise InputError(f"{name} must be an integer >= {least}, got {value!r}", param=name)
        if not isinstance(self.prefix_caching, bool):
            raise InputError(
                f"prefix_caching must be true or false, got {self.prefix_caching!r}", param="prefix_caching"
            )
        if self.mixed_steps not in (None, True, False):
            raise InputError(f"mixed_steps must be true, false or None, got {self.mixed_steps!r}", param="mixed_steps")
        if self.mixed_steps and self.ngram:
            raise InputError(MIXED_NEEDS["speculating"], param="mixed_steps")
        if self.kv_cache_dtype not in (None, "int8"):
            dtype_of(self.kv_cache_dtype)
        if self.attention not in (None, *ATTENTION_IMPLS):
            raise InputError(
                f"attention must be one of {list(ATTENTION_IMPLS)}, got {self.attention!r}", param="attention"
            )

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with `changes`, validated as a new one is."""
        return dataclasses.replace(self, **changes)

    def tokens_per_page(self, backend: str) -> int:
        """`page_size`, or the size the backend's paged kernel reads best (`BACKEND_PAGE_SIZES`); InputError where
        `prefill_tokens` cannot hold such a page, before the engine allocates its pool for it."""
        page_size = self.page_size or BACKEND_PAGE_SIZES.get(backend, PAGE_SIZE)
        check_prefill_tokens(self.prefill_tokens, page_size)
        return page_size

    def context(self, model_context: int) -> int:
        """A row's tokens at most: `max_len`, or the model's context; InputError for more than the model's."""
        if self.max_len is not None and self.max_len > model_context:
            least = LEAST["max_len"]
            raise InputError(f"max_len must be in [{least}, {model_context}] (the model's context), got {self.max_len}")
        return self.max_len or model_context

    def mixes(self, backend: str, paged: bool, speculating: bool, batch_ways: int) -> bool:
        """Whether a step runs a prefill call and a decode step in one pass: `mixed_steps`, or by default on a TPU
        whose decode steps read the pool in place in every layer (`paged`: a mixed step's decode rows run over every
        slot's and page's table, which a gather would copy whole). Never with speculation, whose steps verify
        proposals instead, nor on a mesh whose batch axes split rows (`batch_ways` > 1: a mixed pass runs its tokens
        as one row); InputError where they were asked for so."""
        if speculating or batch_ways > 1:
            if self.mixed_steps:
                raise InputError(MIXED_NEEDS["speculating" if speculating else "batch axes"], param="mixed_steps")
            return False
        return self.mixed_steps if self.mixed_steps is not None else backend == "tpu" and paged

    def speculated(self, drafting: bool) -> int:
        """Tokens proposed per row and step: `speculate` when prompt lookup or a draft model (`drafting`)
        proposes them, else none."""
        return self.speculate if self.ngram or drafting else 0
