"""The generation engine behind `lm.generate`, `meshlm sample`, `meshlm serve` and lm-eval's `generate_until`.

Three parts, as vLLM v1 splits its engine: the runner (`meshlm.serve.runner`: the device, its compiled programs
and their shapes), the scheduler (`meshlm.serve.scheduler`: requests, the queue, slots and KV pages, and the
batch each step runs) and this thin engine, which steps one with the other. A caller adds requests
(`add_request`), reads their outputs as they change (`on_update`) and may `abort` them; `snapshot` reports
the engine's state. The engine steps either on the caller's thread (`generate`, `run`: `lm.generate`,
`meshlm sample`) or on a loop thread of its own (`start`: the server).
"""

from __future__ import annotations

import dataclasses
import threading
import traceback
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from jax.sharding import Mesh

from meshlm import lora, model
from meshlm.config import InputError, MeshlmError, ModelConfig
from meshlm.serve.adapter_slots import Adapter, AdapterSlots, Registered, SlotsBusy
from meshlm.serve.config import PAGE_SIZE, EngineConfig
from meshlm.serve.grammar import Constraint, Grammars
from meshlm.serve.outputs import Completion, RowOutput
from meshlm.serve.params import SamplingParams, check_chunk, check_token_ids
from meshlm.serve.runner import Draft, Runner
from meshlm.serve.scheduler import Request, Scheduler
from meshlm.sharding import SERVING, Rules
from meshlm.tokenizer import Tokenizer

__all__ = [
    "PAGE_SIZE",
    "Draft",
    "Engine",
    "EngineConfig",
    "GenerationFailed",
    "QueueFull",
    "Request",
    "SlotsBusy",
    "Snapshot",
]

DEFAULT_LORA_RANK = 16  # the adapter slots' rank when no adapter is given at start (vLLM's default too)


class QueueFull(Exception):
    """The engine's queue is full; the client should retry later."""


class GenerationFailed(MeshlmError):
    """A row failed while generating (`Request.error`): its constraint failed, or the model produced an id the
    tokenizer does not have. The other rows were not affected."""


@dataclass(frozen=True)
class Snapshot:
    """The engine's state at one moment: what /health and /metrics report."""

    running: int  # rows being generated
    queued: int  # rows waiting for a slot
    max_batch: int  # rows that run at once, as asked (the compiled batch may round it up)
    max_len: int
    page_size: int
    kv_pages: int  # pages a row can be given
    kv_pages_used: int
    kv_live_tokens: int  # tokens in the running rows' caches
    kv_bytes_per_token: int
    prefix_cache_lookups: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of which found
    prefix_cache_hit_rate: float
    tokens_generated: int
    prompt_tokens: int
    tokens_per_second: float  # over the last few seconds
    prefill_calls: int
    decode_calls: int
    proposed: int  # speculated tokens offered
    accepted: int  # of which kept
    compiled_shapes: int
    compile_seconds: float
    cached_shapes: int  # of the compiled shapes, those JAX's persistent compilation cache served (a restart's)
    compiles_since_warm_up: int

    @property
    def kv_tokens(self) -> int:
        return self.kv_pages * self.page_size

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None


def _check_draft(draft: Draft, cfg: ModelConfig, max_len: int, ngram: int) -> None:
    """A draft model must be able to propose every token the target can emit, at every position."""
    if ngram:
        raise InputError("speculate with a draft model or with prompt lookup (ngram), not both")
    if draft.cfg.n_vocab_used != cfg.n_vocab_used:
        raise InputError(
            f"the draft model's vocabulary ({draft.cfg.n_vocab_used} tokens) is not the target's "
            f"({cfg.n_vocab_used}): a draft must share the target's tokenizer"
        )
    if draft.cfg.max_seq_len < max_len:
        raise InputError(f"the draft model's context ({draft.cfg.max_seq_len}) is shorter than max_len ({max_len})")


class Engine:
    """Continuous batching for one model on one mesh, as its `EngineConfig` says (rows, lengths, the KV pool,
    prefix caching, speculation, adapter slots, the loop's chunk and queue; see `meshlm.serve.config`).

    `policy` runs the model (with the config's `attention` and `kv_cache_dtype`, where given). `draft`: a
    smaller model that proposes the config's `speculate` tokens per step. `tokenizer` detokenizes outputs
    (needed for stop strings).

    `adapters` (name -> `Adapter`: weights read at the front door, `meshlm.api.read_adapter`) are LoRA
    adapters that requests may name; they run in the config's `max_adapters` device slots (default: one per
    adapter given) of rank `max_lora_rank` (default: the largest given, else DEFAULT_LORA_RANK), rows of any
    mix of adapters and the base in one batch. An engine without them has no slots; `add_adapter` then needs
    `max_adapters` > 0. The engine reads no files: adapters come as weights (`LanguageModel.read_adapter`
    reads a folder). `rules` lays the weights out on the mesh (`sharding.SERVING`: split over `model` only,
    so a decode step gathers none)."""

    def __init__(
        self,
        params: model.Params,
        cfg: ModelConfig,
        policy: model.Policy,
        mesh: Mesh,
        config: EngineConfig | None = None,
        *,
        draft: Draft | None = None,
        tokenizer: Tokenizer | None = None,
        adapters: Mapping[str, Adapter] | None = None,
        rules: Rules = SERVING,
    ):
        config = config or EngineConfig()
        max_len = config.context(cfg.max_seq_len)
        if draft is not None:
            _check_draft(draft, cfg, max_len, config.ngram)
        speculate = config.speculated(draft is not None)
        kv_cache_dtype, attention = config.kv_cache_dtype or policy.kv_cache_dtype, config.attention or policy.attention
        policy = dataclasses.replace(policy, kv_cache_dtype=kv_cache_dtype, attention=attention)
        self.config, self.cfg, self.tokenizer = config, cfg, tokenizer
        given = {name: adapter.weights for name, adapter in (adapters or {}).items()}
        self.adapters: AdapterSlots | None = None
        if given or config.max_adapters:
            rank = config.max_lora_rank or max((_rank(w) for w in given.values()), default=DEFAULT_LORA_RANK)
            self.adapters = AdapterSlots(len(given) if config.max_adapters is None else config.max_adapters, rank)
        self.runner = Runner(
            params, cfg, policy, mesh, config, draft=draft,
            adapter_slots=0 if self.adapters is None else self.adapters.n + 1,
            adapter_rank=0 if self.adapters is None else self.adapters.rank, rules=rules,
        )  # fmt: skip
        self._device = threading.Lock()  # a step, or a write into the adapter slots, at a time
        self._adapter_requests: weakref.WeakSet[Request] = weakref.WeakSet()  # guarded by _device
        for name, weights in given.items():
            self._register(name, weights, adapters[name].source)
        self.scheduler = Scheduler(
            self.runner.shapes, self.runner.n_pages, cfg.vocab_size, n_tokens=cfg.n_vocab_used,
            prefix_caching=config.prefix_caching, speculate=speculate, ngram=config.ngram, draft=draft is not None,
            max_rows=config.max_batch, prefill_tokens=config.prefill_tokens,
        )  # fmt: skip
        self.max_batch, self.max_len = config.max_batch, self.runner.shapes.max_len
        self.page_size, self.speculate = self.runner.page_size, speculate
        self._requests: weakref.WeakValueDictionary[str, Request] = weakref.WeakValueDictionary()
        self._loop: _Loop | None = None
        self._grammars: dict[Tokenizer, Grammars] = {}  # compiled output constraints, per tokenizer
        self._grammars_lock = threading.Lock()

    def kv_bytes_per_token(self) -> int:
        """Bytes of keys and values one token takes on each device (the draft model's included)."""
        return self.runner.kv_bytes_per_token()

    def warm_up(self) -> tuple[int, float]:
        """Compile every program shape the engine can use and load each; (shapes, seconds)."""
        return self.runner.warm_up()

    def check(self, prompt_len: int, max_new: int) -> None:
        """A clear error (InputError) for a request that can never run."""
        self.scheduler.check(prompt_len, max_new)

    def update_weights(self, params: model.Params) -> None:
        """Generate with new weights of the same model from now on (a trainer's policy after its update): they
        replace the engine's own, laid out by its `rules` (a trainer's weights laid out so are not copied). Only
        while no request is queued or running; the prefix cache, computed with the old weights, is emptied."""
        with self._device:
            if self.scheduler.has_work() or (self._loop is not None and self._loop.waiting):
                raise InputError("an engine's weights change only while no request is queued or running")
            self.runner.set_weights(params)
            self.scheduler.pool.recycle(self.runner.zero_pages)
            self.scheduler.pool.reset()

    # adapters -------------------------------------------------------------------------------------

    def adapter_sources(self) -> dict[str, str]:
        """The LoRA adapters requests may name, in the order they were loaded, with where each was read from."""
        return {} if self.adapters is None else {a.name: a.source for a in self.adapters.registered.values()}

    def check_adapter_name(self, name: str) -> None:
        """InputError unless an adapter could be added under `name`: the engine has adapter slots, and no
        adapter has the name. The front door asks before it reads an adapter's files."""
        if self.adapters is None:
            raise InputError("this engine has no adapter slots: start it with adapters or max_adapters > 0")
        if not isinstance(name, str) or not name:
            raise InputError("an adapter needs a name", param="lora_name")
        if name in self.adapters.registered:
            raise InputError(f"an adapter named {name!r} is loaded already; unload it first", param="lora_name")

    def add_adapter(self, name: str, adapter: Adapter) -> None:
        """Register a LoRA adapter's weights under `name`; it takes a device slot when a request first names
        it. Compiles nothing: every program serves any adapter in any slot."""
        self.check_adapter_name(name)
        self._register(name, adapter.weights, adapter.source)

    def unload_adapter(self, name: str) -> None:
        """Forget adapter `name` (InputError while a queued or running request uses it)."""
        if self.adapters is None:
            raise InputError(f"no adapter named {name!r} is loaded", param="lora_name")
        with self._device:
            self.adapters.unregister(name, self._busy())

    def _register(self, name: str, weights: dict, source: str) -> None:
        slot = lora.fill_slot(weights, model.projections(self.cfg), self.adapters.rank)
        with self._device:
            self.adapters.register(Registered(name, source, slot))

    def _busy(self) -> set[int]:
        """The adapters (keys) that queued or running requests use. Called under `_device`."""
        return {r.adapter_key for r in list(self._adapter_requests) if not r.finished}

    def _place(self, names: set[str]) -> dict[str, Registered]:
        """Each named adapter in a device slot, written there if it was not (see `AdapterSlots.place`).
        Called under `_device`."""
        if self.adapters is None:
            raise InputError(f"no adapter named {sorted(names)[0]!r} is loaded: this engine has no adapters",
                             param="model")  # fmt: skip
        placed, busy = {}, self._busy()
        for name in sorted(names):
            adapter, write = self.adapters.place(name, busy)
            if write:
                self.runner.write_adapter(adapter.slot, adapter.weights)
            placed[name] = adapter
            busy.add(adapter.key)  # not to be evicted by the next name
        return placed

    # requests -------------------------------------------------------------------------------------

    def add_requests(
        self,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        on_update: Callable[[int], None] | None = None,
        tokenizer: Tokenizer | None = None,
        adapters: Sequence[str | None] | None = None,
    ) -> list[Request]:
        """Queue one row per prompt, all or none (InputError for a row that can never run, QueueFull when the
        loop's queue has no room for them all). `on_update(i)` is called from the engine's thread after every
        change to row i's output; the returned requests hold the outputs (read them under `request.lock`).
        `adapters[i]` names the LoRA adapter row i runs (None: the base alone); SlotsBusy when every
        adapter slot runs adapters of live requests."""
        if len(prompts) != len(params):
            raise InputError("one SamplingParams per prompt is needed")
        adapters = [None] * len(prompts) if adapters is None else list(adapters)
        if len(adapters) != len(prompts):
            raise InputError("one adapter name (or None) per prompt is needed")
        tokenizer = tokenizer or self.tokenizer
        if any(p.stop for p in params) and tokenizer is None:
            raise InputError("stop strings need a tokenizer")
        for prompt, sp in zip(prompts, params, strict=True):
            self.check(len(prompt), sp.max_new_tokens)
            for name, ids in (("prompt", prompt), ("stop_token_ids", sp.stop_token_ids),
                              ("logit_bias", [i for i, _ in sp.logit_bias])):  # fmt: skip
                check_token_ids(ids, self.cfg.n_vocab_used, name)
        grammars = self._constraints(params, tokenizer)
        requests = [
            Request(list(p), RowOutput(sp, tokenizer), notify=None if on_update is None else _bind(on_update, i),
                    matcher=None if sp.constraint is None else grammars.matcher(sp.constraint))
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
        ]  # fmt: skip
        if named := {name for name in adapters if name is not None}:
            with self._device:  # placed and marked in use at once: no other thread evicts them in between
                placed = self._place(named)
                for r, name in zip(requests, adapters, strict=True):
                    if name is not None:
                        r.adapter, r.adapter_key = placed[name].slot, placed[name].key
                        self._adapter_requests.add(r)
        for r in requests:
            self._requests[r.id] = r
        try:
            if self._loop is not None:
                self._loop.submit(requests)
            else:
                self.scheduler.submit(requests)
        except BaseException:
            for r in requests:  # never to run: their adapters are not in use
                r.cancelled = True
            raise
        return requests

    def _constraints(self, params: Sequence[SamplingParams], tokenizer: Tokenizer | None) -> Grammars | None:
        """The compiler of the rows' output constraints, each compiled (cached) and checked: InputError for an
        invalid one, for one without a tokenizer, and under speculative decoding."""
        constraints = {sp.constraint for sp in params if sp.constraint is not None}
        if not constraints:
            return None
        grammars = self._grammars_for(tokenizer, next(iter(constraints)))
        for c in constraints:
            grammars.check(c)
        return grammars

    def _grammars_for(self, tokenizer: Tokenizer | None, c: Constraint) -> Grammars:
        if self.speculate:
            raise InputError("output constraints do not run with speculative decoding; serve without --ngram/--draft",
                             param=c.param)  # fmt: skip
        if tokenizer is None:
            raise InputError("output constraints need a tokenizer")
        with self._grammars_lock:
            if tokenizer not in self._grammars:
                self._grammars[tokenizer] = Grammars(tokenizer, self.cfg.vocab_size)
            return self._grammars[tokenizer]

    def check_constraint(self, constraint: Constraint, tokenizer: Tokenizer | None = None) -> None:
        """Compile `constraint` and time its first token's mask (`Grammars.vet`): InputError for one that is
        invalid, over the size budgets or too slow to run beside other rows. Works on the host alone (no device,
        no engine lock), so a server runs it on a worker thread, off its event loop and the engine's."""
        self._grammars_for(tokenizer or self.tokenizer, constraint).vet(constraint)

    def add_request(
        self,
        ids: Sequence[int],
        params: SamplingParams,
        on_update: Callable[[int], None] | None = None,
        adapter: str | None = None,
    ) -> Request:
        """Queue one row (see `add_requests`)."""
        return self.add_requests([ids], [params], on_update, adapters=[adapter])[0]

    def abort(self, request_id: str) -> None:
        """Stop a request: its slot and pages are freed at the engine's next step. Unknown or finished: nothing."""
        if (r := self._requests.get(request_id)) is not None and not r.output.finished:
            r.cancelled = True

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def snapshot(self) -> Snapshot:
        s, pool, r = self.scheduler.stats, self.scheduler.pool, self.runner
        running = self.scheduler.running
        return Snapshot(
            running=len(running), queued=len(self.scheduler.queue) + (self._loop.waiting if self._loop else 0),
            max_batch=self.max_batch, max_len=self.max_len, page_size=self.page_size, kv_pages=pool.capacity,
            kv_pages_used=pool.used, kv_live_tokens=sum(x.length for x in running),
            kv_bytes_per_token=self.kv_bytes_per_token(), prefix_cache_lookups=pool.lookups,
            prefix_cache_hits=pool.hits, prefix_cache_hit_rate=pool.hit_rate, tokens_generated=s.tokens_generated,
            prompt_tokens=s.prompt_tokens, tokens_per_second=s.tokens_per_second(), prefill_calls=s.prefill_calls,
            decode_calls=s.decode_calls, proposed=s.proposed, accepted=s.accepted, compiled_shapes=r.compiled_shapes,
            compile_seconds=r.compile_seconds, cached_shapes=r.cached_shapes,
            compiles_since_warm_up=r.compiles_since_warm_up,
        )  # fmt: skip

    # stepping -------------------------------------------------------------------------------------

    def step(self, chunk: int = 4) -> None:
        """Drop cancelled rows, admit what fits (prefill calls grouped by length), then decode up to `chunk`
        tokens of every running row. Where the engine mixes (`EngineConfig.mixed_steps`), each one-row prefill call
        runs in one pass over the weights with one of those tokens (`Runner.run_mixed`), while the chunk lasts."""
        check_chunk(chunk)
        scheduler, runner = self.scheduler, self.runner
        with self._device:
            scheduler.drop_finished()
            scheduler.pool.recycle(runner.zero_pages)
            for work in scheduler.schedule_prefill():  # each row keeps its slot and pages until the step's calls ran
                if chunk and runner.mixes(work.batch) and (rows := scheduler.schedule_decode(1)) is not None:
                    prefilled, decoded = runner.run_mixed(work.batch, rows.batch)
                    scheduler.update(rows, decoded, drop=False)
                    chunk -= 1
                else:
                    prefilled = runner.run(work.batch)
                scheduler.update(work, prefilled, drop=False)
            scheduler.drop_finished()
            if chunk and (work := scheduler.schedule_decode(chunk)) is not None:
                scheduler.update(work, runner.run(work.batch))

    def fail_all(self, error: str) -> None:
        """Fail every queued and running row and start from an empty cache (after a device failure, which may
        have consumed the donated buffers)."""
        with self._device:
            self.scheduler.fail_all(error)
            self.runner.reset()

    def start(self, chunk: int | None = None, max_queue: int | None = None) -> None:
        """Step on a thread of the engine's own while there is work (a server), `chunk` decode steps per device
        call with at most `max_queue` rows waiting (None: the config's)."""
        if self._loop is not None:
            raise RuntimeError("the engine's loop is already running")
        changes = {name: value for name, value in (("chunk", chunk), ("max_queue", max_queue)) if value is not None}
        loop = self.config.replace(**changes)
        self._loop = _Loop(self, loop.chunk, loop.max_queue)

    def stop(self) -> None:
        """Stop the loop thread (rows in flight stay where they are)."""
        if self._loop is not None:
            self._loop.stop()
            self._loop = None

    # a fixed set of prompts, on the caller's thread -------------------------------------------------

    def run(
        self,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        tokenizer: Tokenizer | None = None,
        chunk: int = 64,
        adapters: Sequence[str | None] | None = None,
    ) -> Iterator[list[RowOutput]]:
        """Generate for token prompts, yielding their `RowOutput`s after every engine step until all have
        finished; streaming reads them. Rows beyond `max_batch` or the pool wait for earlier ones.
        `adapters` as in `add_requests`."""
        check_chunk(chunk)
        if self._loop is not None:
            raise RuntimeError("the engine steps on its own thread; add requests instead")
        requests = self.add_requests(prompts, params, tokenizer=tokenizer, adapters=adapters)
        try:
            while not all(r.finished for r in requests):
                try:
                    self.step(chunk)
                except Exception:
                    self.fail_all("generation failed")
                    raise
                yield [r.output for r in requests]
            if failed := next((r for r in requests if r.error is not None), None):
                raise GenerationFailed(failed.error)
        finally:  # the caller stopped early: free what is still held
            for r in requests:
                r.cancelled = not r.output.finished
            self.scheduler.drop_finished()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        tokenizer: Tokenizer | None = None,
        chunk: int = 64,
        adapters: Sequence[str | None] | None = None,
    ) -> list[Completion]:
        """Generate for token prompts until every row finishes (`adapters` as in `add_requests`)."""
        outputs: list[RowOutput] = []
        for outputs in self.run(prompts, params, tokenizer, chunk, adapters):  # noqa: B007
            pass
        return [o.result() for o in outputs]


def _rank(adapter: dict) -> int:
    return max(parts["a"].shape[-1] for parts in adapter.values())


def _bind(on_update: Callable[[int], None], i: int) -> Callable[[], None]:
    return lambda: on_update(i)


class _Loop:
    """The engine's thread: takes added rows into the scheduler and steps while there is work. Callers only
    add rows (bounded by `max_queue` waiting) and flag cancelled ones; the step frees them."""

    def __init__(self, engine: Engine, chunk: int, max_queue: int):
        self.engine, self.chunk, self.max_queue = engine, chunk, max_queue
        self.incoming: deque[Request] = deque()
        self.wake = threading.Condition()
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="meshlm-engine", daemon=True)
        self.thread.start()

    @property
    def waiting(self) -> int:
        return len(self.incoming)

    def submit(self, rows: list[Request]) -> None:
        if len(rows) > self.max_queue:
            raise InputError(f"{len(rows)} rows at once; this engine queues at most {self.max_queue} (max_queue)")
        with self.wake:
            if len(self.incoming) + len(self.engine.scheduler.queue) + len(rows) > self.max_queue:
                raise QueueFull
            self.incoming.extend(rows)
            self.wake.notify()

    def stop(self) -> None:
        with self.wake:
            self.stopped = True
            self.wake.notify()
        self.thread.join(timeout=10)

    def _run(self) -> None:
        scheduler = self.engine.scheduler
        while True:
            with self.wake:
                while not self.stopped and not self.incoming and not scheduler.has_work():
                    self.wake.wait()
                if self.stopped:
                    return
                scheduler.submit(list(self.incoming))  # checked when added
                self.incoming.clear()
            try:
                self.engine.step(self.chunk)
            except Exception as e:  # a device failure fails the rows in flight, never the server
                traceback.print_exc()
                self.engine.fail_all(f"generation failed: {type(e).__name__}: {e}")
