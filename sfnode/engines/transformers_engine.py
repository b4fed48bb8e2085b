"""The transformers engine: a scheduler on the reactor, a model runner on one worker thread.

The engine is split the way vLLM and TGI split theirs (docs/engine.md section 3):

- :class:`~sfnode.engines.scheduling.scheduler.Scheduler` (pure, on the reactor thread) decides each
step:
  who decodes, which prompt chunks ride along, who is admitted, which KV blocks are reused;
- a model runner (:class:`~sfnode.engines.runners.llama.LlamaRunner` for Llama-family models,
  :class:`~sfnode.engines.runners.forward.ModelForwardRunner` for anything else) executes the step
  on the worker thread, one forward pass, and samples;
- this module joins them: each step's plan goes to a one-thread pool with ``deferToThreadPool``,
  its output comes back as a Deferred on the reactor, the scheduler plans the next step (which is
  sent off at once) and only then are the tokens and ends handed to the generations, so handing
  them over overlaps the next step's computation.

Cancelling, deadlines and statistics are therefore plain reactor-side bookkeeping with no locks.

Speculative decoding (``speculative="ngram"``, docs/engine.md section 3.1): the scheduler drafts
each decoding lane's next tokens from its own context, the Llama runner verifies them in the same
pass, and the sampler's own rule keeps those it would have drawn; the model-forward runner does
not speculate.

Constraints (docs/engine.md section 2.4): with the model's tokenizer the engine builds a
:class:`~sfnode.decoding.constraint.Vocabulary`; a constrained request's
:class:`~sfnode.decoding.constraint.LaneStage` is prepared (its grammar compiled, delivered tokens
replayed) on a thread of its own before the request queues, and each step's masks are computed
by a :class:`~sfnode.engines.runners.masks.MaskWorker` while the step's forward pass runs.

This module must never touch the model except through the runner on the worker thread, never let
one generation's failure stop the engine (a failed step fails the lanes it carried and the engine
goes on), and never sample with a random generator (:mod:`sfnode.decoding.sampler` does every draw).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from twisted.internet import defer
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.python.threadpool import ThreadPool

from sfnode.decoding.constraint import ConstraintError, LaneStage, Vocabulary
from sfnode.engines import DEFAULT_DRAFT_TOKENS, SPECULATIVE_MODES, WEIGHT_MODES
from sfnode.engines.kernels import openmp
from sfnode.engines.runners.forward import ModelForwardRunner
from sfnode.engines.runners.hidden import decode_hidden, encode_hidden
from sfnode.engines.runners.llama import LlamaRunner, llama_unsupported
from sfnode.engines.runners.masks import MaskWorker
from sfnode.engines.scheduling.drafts import Speculation
from sfnode.engines.scheduling.pace import DEFAULT_STEP_MS, RateEstimator, StepCost, StepRates
from sfnode.engines.scheduling.plan import StepOutput, StepPlan
from sfnode.engines.scheduling.prefix_cache import PrefixCache, PrefixCacheStats
from sfnode.engines.scheduling.scheduler import (
    Emitted,
    Ended,
    Request,
    Scheduler,
    SchedulerCounts,
    blocks_for,
)
from sfnode.engines.weights.llama import WeightsError, gather_weights
from sfnode.engines.weights.loading import LoadedModel
from sfnode.generation import (
    Engine,
    EngineRefusal,
    EngineStatistics,
    EngineStop,
    Generation,
    GenerationRequest,
    GenerationResult,
    StageForwardError,
    StageResult,
    StreamTooLong,
    TokenBatch,
    TokenLogprob,
    TokenSink,
)
from sfnode.linkf.prefix_blocks import KV_BLOCK_TOKENS

__all__ = ["TransformersEngine", "decode_hidden", "encode_hidden", "eos_ids_of"]

log = Logger(namespace="sfnode.engines.transformers")


def eos_ids_of(model: Any) -> frozenset[int]:
    """The model's EOS ids, from its generation config and its config (either may list several)."""
    found: set[int] = set()
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        value = getattr(source, "eos_token_id", None)
        if value is None:
            continue
        if isinstance(value, int):
            found.add(value)
        else:
            found.update(int(v) for v in value)
    return frozenset(found)


def _release_projections(model: Any, embedding: bool) -> None:
    """Replace the float weights of every decoder layer's projections (and with ``embedding``
    the token embedding's and the output head's) with empty tensors."""
    modules = [model.model.embed_tokens, model.lm_head] if embedding else []
    for module in modules:
        module.weight = torch.nn.Parameter(
            torch.empty(0, dtype=module.weight.dtype), requires_grad=False
        )
    for layer in model.model.layers:
        for module in (
            layer.self_attn.q_proj,
            layer.self_attn.k_proj,
            layer.self_attn.v_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_proj,
            layer.mlp.up_proj,
            layer.mlp.down_proj,
        ):
            module.weight = torch.nn.Parameter(
                torch.empty(0, dtype=module.weight.dtype), requires_grad=False
            )


def _trim_heap() -> None:
    """Return free heap pages to the system (glibc's ``malloc_trim``; nothing elsewhere)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is not None:
        trim(0)


class _Runner(Protocol):
    def run(self, plan: StepPlan) -> StepOutput: ...

    def stage(
        self, tokens: Sequence[int], start: int, end: int, hidden_in: torch.Tensor | None
    ) -> StageResult: ...


class _Generation:
    """The node's handle on one generation; lives on the reactor thread."""

    def __init__(self, engine: TransformersEngine, on_tokens: TokenSink) -> None:
        self._engine = engine
        self._on_tokens = on_tokens
        self._delivered: list[int] = []
        self._cancelled = False
        self._result: defer.Deferred[GenerationResult] = defer.Deferred(lambda _d: self.cancel())
        self.request: Request | None = None
        self.preparing = False
        """Its constraint's stage is being prepared; it queues when that is done."""

    @property
    def result(self) -> defer.Deferred[GenerationResult]:
        return self._result

    def cancel(self) -> None:
        if self._result.called or self._cancelled:
            return
        self._cancelled = True
        if self.request is not None:
            self._engine._cancel(self.request)
        elif self.preparing:
            self._finish(EngineStop.CANCELLED)

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def _deliver(self, tokens: list[int], logprobs: list[TokenLogprob] | None) -> None:
        if self._result.called or self._cancelled:
            return
        self._delivered.extend(tokens)
        try:
            batch = TokenBatch(tuple(tokens), None if logprobs is None else tuple(logprobs))
            self._on_tokens(batch)
        except Exception:
            log.failure("on_tokens raised; cancelling the generation")
            self.cancel()

    def _finish(self, stop: EngineStop) -> None:
        if self._result.called:
            return
        if self._cancelled:
            stop = EngineStop.CANCELLED
        self._result.callback(GenerationResult(tuple(self._delivered), stop))

    def _fail(self, error: BaseException) -> None:
        if self._result.called:
            return
        if self._cancelled:
            self._result.callback(GenerationResult(tuple(self._delivered), EngineStop.CANCELLED))
        else:
            self._result.errback(error)


class TransformersEngine:
    """An :class:`sfnode.generation.Engine` over a transformers causal LM (see the module)."""

    def __init__(
        self,
        model: Any,
        reactor: Any,
        *,
        max_lanes: int = 8,
        kv_blocks: int | None = None,
        context_window: int | None = None,
        prefill_chunk: int = 256,
        step_tokens: int = 512,
        step_ms: float = DEFAULT_STEP_MS,
        eos_ids: Sequence[int] | None = None,
        weights: str = "auto",
        gguf: Path | None = None,
        weights_cache: Path | None = None,
        prefix_cache: bool = True,
        prefix_cache_blocks: int | None = None,
        interactive_lanes: int = 1,
        dense_copies: bool = False,
        onednn: bool = True,
        lean_step: bool = True,
        kernels: str = "auto",
        fused_step: bool = True,
        tokenizer: Any = None,
        speculative: str = "off",
        draft_tokens: int = DEFAULT_DRAFT_TOKENS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``weights`` is a mode of :data:`~sfnode.engines.weights.llama.WEIGHT_MODES` (``gguf``
        is the file the model came from, ``weights_cache`` where packed weights are kept).
        ``lean_step`` False runs the model's own forward even for a Llama (``--stock-kernels``,
        with ``onednn`` False too); ``prefix_cache`` reuses the KV of earlier prompts' blocks
        (Llama runner only), in a pool of ``prefix_cache_blocks`` blocks (default: ``kv_blocks``).
        ``interactive_lanes`` lanes are kept for interactive requests (batch work never holds
        them).  ``dense_copies`` lets long prompt chunks multiply by bfloat16 copies of
        quantized weights where that is measured to be faster at start; off by default, since a
        position's KV then depends on the size of the chunk it was computed in, and a reused
        prefix or a failover no longer continues a stream exactly (docs/engine.md section 5).
        ``step_ms`` is the time budget of a step's batch prompt chunks while interactive work
        may need the engine (0: steps are sized by ``step_tokens`` only; docs/engine.md section
        3), checked against the rates measured on this machine.  ``kernels`` picks
        the family of the quantized kernels (``auto``: measured at start, docs/engine.md section
        5.1); ``fused_step`` False runs every layer as separate torch operators even where the
        native fused calls could (docs/engine.md section 5.2).  ``tokenizer`` (the model's
        transformers fast tokenizer) lets it honour constraints (docs/engine.md section 2.4);
        without one, ``supports_constraints`` is false.  ``speculative`` ``ngram`` drafts up to
        ``draft_tokens`` tokens a lane per step by prompt lookup and verifies them in the step
        (docs/engine.md section 3.1; the Llama runner only).
        """
        if max_lanes < 1:
            raise ValueError("max_lanes must be at least 1")
        if speculative not in SPECULATIVE_MODES:
            raise ValueError(
                f"speculative must be one of {', '.join(SPECULATIVE_MODES)}, not {speculative!r}"
            )
        if draft_tokens < 1:
            raise ValueError("draft_tokens must be at least 1")
        if weights not in WEIGHT_MODES:
            raise ValueError(f"weights must be one of {', '.join(WEIGHT_MODES)}, not {weights!r}")
        self._reactor = reactor
        self._clock = clock
        config = model.config
        self._max_lanes = max_lanes
        model_window = int(getattr(config, "max_position_embeddings", 0) or 0)
        window = model_window
        if context_window:
            window = min(window, context_window) if window else context_window
        if window <= 0:
            raise ValueError("the model has no max_position_embeddings; pass context_window")
        self._kv_blocks_total = (
            kv_blocks if kv_blocks is not None else blocks_for(window) * max_lanes
        )
        if self._kv_blocks_total < 1:
            raise ValueError("kv_blocks must be at least 1")
        self._window = min(window, self._kv_blocks_total * KV_BLOCK_TOKENS)
        self._eos_ids = frozenset(eos_ids) if eos_ids is not None else eos_ids_of(model)
        self._n_layers = int(getattr(config, "num_hidden_layers", 0))
        self._vocab_size = int(getattr(config, "vocab_size", 0))
        self._hidden_size = int(getattr(config, "hidden_size", 0))

        self.vocabulary: Vocabulary | None = None
        self._masks: MaskWorker | None = None
        if tokenizer is not None:
            started = time.perf_counter()
            try:
                self.vocabulary = Vocabulary.of_tokenizer(
                    tokenizer, size=self._vocab_size, eos_ids=self._eos_ids
                )
            except ValueError as e:
                # A slow tokenizer, or a model without an EOS id: served without constraints.
                log.warn("constraints are not available with this model: {error}", error=str(e))
            else:
                self._masks = MaskWorker(self.vocabulary)
                log.info(
                    "constraints: the grammar library read {n} tokens in {s:.2f} s",
                    n=self._vocab_size,
                    s=time.perf_counter() - started,
                )
        unsupported = llama_unsupported(model) if lean_step else "--stock-kernels"
        self._runner: _Runner
        pool_blocks = 0
        if unsupported is None:
            served = gather_weights(
                model,
                weights,
                gguf=gguf,
                cache_file=weights_cache,
                dense_copies=dense_copies,
                kernels=kernels,
                fused_step=fused_step,
            )
            if prefix_cache:
                pool_blocks = (
                    prefix_cache_blocks
                    if prefix_cache_blocks is not None
                    else self._kv_blocks_total
                )
            runner = LlamaRunner.for_model(
                model,
                served,
                slots=max_lanes,
                window=self._window,
                pool_blocks=pool_blocks,
                fused=fused_step,
                masks=self._masks,
            )
            self._runner = runner
            self.fused_step = runner.fused is not None
            self._holds_model_embedding = served.holds_model_embedding
            self.weights_mode = served.mode
            self.kernels = served.describe()
            self.onednn_layers = 0
            self._activations = served.activations
            log.info(
                "serving {layers} layers with weights {mode} ({kernels}); activations and KV "
                "in {dtype}; prefix cache {prefix}; {fused}",
                layers=self._n_layers,
                mode=served.mode,
                kernels=self.kernels,
                dtype=str(served.activations).removeprefix("torch."),
                prefix=f"{pool_blocks} blocks" if pool_blocks else "off",
                fused=(
                    "the whole step (layers, attention, head) in two native calls"
                    if runner.fused is not None
                    else f"layers run as torch operators (no native step: {runner.fused_reason})"
                ),
            )
        else:
            dtype = next(model.parameters()).dtype
            if weights not in ("auto", str(dtype).removeprefix("torch.")):
                raise WeightsError(
                    f"--weights {weights} needs the Llama runner, which cannot serve this model "
                    f"({unsupported}); its own forward serves {dtype} weights"
                )
            forward = ModelForwardRunner(model, onednn=onednn, masks=self._masks)
            self._runner = forward
            self.fused_step = False
            self._holds_model_embedding = True
            self.weights_mode = str(dtype).removeprefix("torch.")
            self.onednn_layers = forward.onednn_layers
            self.kernels = f"the model's own forward ({self.onednn_layers} layers on oneDNN)"
            self._activations = dtype
            log.info(
                "serving through the model's own forward ({why}); {layers} linear layers on oneDNN",
                why=unsupported,
                layers=self.onednn_layers,
            )
        speculation = None
        if speculative == "ngram":
            if isinstance(self._runner, LlamaRunner):
                speculation = Speculation(draft_tokens=draft_tokens)
                log.info(
                    "speculative decoding: up to {k} tokens a lane per step, drafted from "
                    "{low}- to {high}-grams of its own context",
                    k=draft_tokens,
                    low=speculation.ngram_min,
                    high=speculation.ngram_max,
                )
            else:
                log.warn(
                    "speculative decoding is off: the model's own forward does not verify drafts "
                    "({why})",
                    why=unsupported,
                )
        self.speculation = speculation
        """How the scheduler drafts, or None (docs/engine.md section 3.1)."""
        self.prefix_cache = PrefixCache(pool_blocks) if pool_blocks else None
        salt = f"{self.weights_mode}|{self._activations}|{self._n_layers}".encode()
        self._scheduler = Scheduler(
            lanes=max_lanes,
            kv_blocks=self._kv_blocks_total,
            prefill_chunk=prefill_chunk,
            step_tokens=step_tokens,
            prefix=self.prefix_cache,
            salt=salt,
            interactive_lanes=interactive_lanes,
            speculation=speculation,
            step_ms=step_ms,
        )
        self._pace = RateEstimator()
        self._pool = ThreadPool(minthreads=1, maxthreads=1, name="sfnode-engine")
        self.exactness: defer.Deferred[str | None] = defer.Deferred()
        """Fires once the start-up check has run (Llama runner only): with None when a
        position's KV does not depend on how its prompt is cut into steps, else what differed
        (docs/engine.md section 4)."""
        self._grammar_pool = ThreadPool(minthreads=0, maxthreads=1, name="sfnode-grammar")
        """Prepares constrained requests' stages (compiling a grammar can take 100 ms)."""
        self._started = False
        self._stopping = False
        self._stepping = False
        self._stop_waiters: list[defer.Deferred[None]] = []
        self._stopped = False

    @classmethod
    def from_loaded(
        cls,
        loaded: LoadedModel,
        reactor: Any,
        *,
        release_float_weights: bool = False,
        **kwargs: Any,
    ) -> TransformersEngine:
        """An engine over a model from :func:`sfnode.engines.weights.loading.load_model` (same
        keywords); a model loaded from a GGUF file serves the file's own quantized weights
        (``--weights auto``).

        With ``release_float_weights`` (the node, which owns ``loaded``) the model's float
        projection weights are dropped once the runner holds its own quantized copies: they
        are most of the model's memory, and nothing reads them afterwards.  The model object
        cannot then run its own forward.
        """
        if loaded.source.suffix.lower() == ".gguf":
            kwargs.setdefault("gguf", loaded.source)
            kwargs.setdefault("weights_cache", loaded.folder / "packed-weights.safetensors")
        kwargs.setdefault("tokenizer", loaded.tokenizer)
        engine = cls(loaded.model, reactor, **kwargs)
        if release_float_weights and engine.lean_step:
            _release_projections(loaded.model, embedding=not engine._holds_model_embedding)
            # Give the freed heap back (packing and measuring at start leave much of it).
            _trim_heap()
        return engine

    # -- the Engine interface (reactor thread) -----------------------------------------------

    @property
    def context_window(self) -> int:
        return self._window

    @property
    def n_layers(self) -> int:
        return self._n_layers

    @property
    def lean_step(self) -> bool:
        """Whether steps run through :class:`LlamaRunner` rather than the model's forward."""
        return isinstance(self._runner, LlamaRunner)

    @property
    def max_lanes(self) -> int:
        return self._max_lanes

    @property
    def supports_logprobs(self) -> bool:
        """Token logprobs are computed for generations that ask (docs/protocol.md 12.1)."""
        return True

    @property
    def supports_constraints(self) -> bool:
        """Constraints are honoured when the engine has the model's vocabulary (its
        tokenizer), docs/protocol.md section 12.3."""
        return self.vocabulary is not None

    def mask_figures(self) -> tuple[int, float, float]:
        """(grammar masks computed, seconds computing them, seconds steps waited for them
        after their forward pass), docs/engine.md section 2.4; zeros without constraints."""
        return self._masks.figures() if self._masks is not None else (0, 0.0, 0.0)

    @property
    def eos_ids(self) -> frozenset[int]:
        return self._eos_ids

    @property
    def steps(self) -> int:
        """Forward passes run so far (decode and prompt rows together count once)."""
        return self._scheduler.counts.steps

    def step_counts(self) -> SchedulerCounts:
        """The scheduler's cumulative figures: steps, decode rows and the tokens they gave,
        draft tokens verified and accepted (docs/engine.md section 3.1)."""
        return self._scheduler.counts

    def prefix_statistics(self) -> PrefixCacheStats | None:
        """The prefix cache's figures, or None without one."""
        return self.prefix_cache.stats if self.prefix_cache is not None else None

    def statistics(self) -> EngineStatistics:
        scheduler = self._scheduler
        return EngineStatistics(
            decoded_tokens=scheduler.counts.decoded,
            prefilled_tokens=scheduler.counts.prefilled,
            queue_depth=len(scheduler.waiting),
            lanes_active=len(scheduler.running),
            kv_blocks_used=scheduler.kv_blocks_used,
            kv_blocks_total=self._kv_blocks_total,
        )

    def submit(self, request: GenerationRequest, on_tokens: TokenSink) -> _Generation:
        handle = _Generation(self, on_tokens)
        context = tuple(int(t) for t in request.context)
        if not context:
            handle._fail(EngineRefusal("the context is empty; there is nothing to extend"))
            return handle
        if len(context) > self._window:
            handle._fail(StreamTooLong(len(context), self._window))
            return handle
        if self._stopping:
            handle._fail(RuntimeError("the engine is stopped"))
            return handle
        if min(context) < 0 or max(context) >= self._vocab_size:
            bad = next(t for t in context if not 0 <= t < self._vocab_size)
            handle._fail(
                EngineRefusal(f"token id {bad} is outside the vocabulary of {self._vocab_size}")
            )
            return handle
        if request.max_new <= 0 or len(context) >= self._window:
            handle._finish(EngineStop.LENGTH)
            return handle
        limit = min(len(context) + request.max_new, self._window)
        reserve = min(blocks_for(limit), self._kv_blocks_total)
        deadline = self._clock() + request.max_wall_ms / 1000.0 if request.max_wall_ms > 0 else None
        job = Request(
            handle=handle,
            context=context,
            params=request.params,
            max_new=request.max_new,
            token_limit=min(limit, reserve * KV_BLOCK_TOKENS),
            reserve_blocks=reserve,
            eos_ids=self._eos_ids,
            deadline=deadline,
            interactive=request.interactive,
        )
        constraint = request.constraint
        if constraint is None:
            self._queue(handle, job)
        elif constraint.grammar is None:
            # Controls alone: nothing to compile.
            try:
                job.stage = LaneStage.prepare(None, constraint, context)
            except ConstraintError as e:
                handle._fail(EngineRefusal(f"the constraint cannot be honoured: {e}"))
                return handle
            self._queue(handle, job)
        elif self.vocabulary is None:
            handle._fail(EngineRefusal("this engine has no vocabulary for grammars"))
        else:
            handle.preparing = True
            if not self._grammar_pool.started:
                self._grammar_pool.start()
            prepared: defer.Deferred[LaneStage] = deferToThreadPool(
                self._reactor,
                self._grammar_pool,
                LaneStage.prepare,
                self.vocabulary,
                constraint,
                context,
            )
            prepared.addCallbacks(
                self._prepared, self._unprepared, callbackArgs=(handle, job), errbackArgs=(handle,)
            )
        return handle

    def _queue(self, handle: _Generation, job: Request) -> None:
        handle.request = job
        self._scheduler.submit(job)
        self._kick()

    def _prepared(self, stage: LaneStage, handle: _Generation, job: Request) -> None:
        handle.preparing = False
        if handle.cancelled or handle.result.called:
            return
        if self._stopping:
            handle._finish(EngineStop.CANCELLED)
            return
        job.stage = stage
        self._queue(handle, job)

    def _unprepared(self, failure: Failure, handle: _Generation) -> None:
        handle.preparing = False
        if isinstance(failure.value, ConstraintError):
            handle._fail(EngineRefusal(f"the constraint cannot be honoured: {failure.value}"))
        else:
            handle._fail(failure.value if failure.value is not None else RuntimeError("failed"))

    def stage_forward(
        self, tokens: Sequence[int], start_layer: int, end_layer: int, hidden_in: bytes | None
    ) -> defer.Deferred[StageResult]:
        if not 0 <= start_layer <= end_layer <= self._n_layers:
            return defer.fail(
                StageForwardError(
                    f"bad layer bounds [{start_layer}, {end_layer}) for {self._n_layers} layers"
                )
            )
        if hidden_in is None and (start_layer != 0 or not tokens):
            return defer.fail(
                StageForwardError("a stage without hidden input must start at layer 0 with tokens")
            )
        if self._stopping or not self._started:
            return defer.fail(StageForwardError("the engine is stopped"))
        try:
            hidden = None if hidden_in is None else decode_hidden(hidden_in, self._hidden_size)
        except StageForwardError as e:
            return defer.fail(e)
        d: defer.Deferred[StageResult] = deferToThreadPool(
            self._reactor,
            self._pool,
            self._runner.stage,
            [int(t) for t in tokens],
            start_layer,
            end_layer,
            hidden,
        )

        def unexpected(failure: Failure) -> Failure | StageResult:
            if isinstance(failure.value, StageForwardError):
                return failure
            log.failure("stage forward failed", failure)
            raise StageForwardError(f"stage forward failed: {failure.value}")

        d.addErrback(unexpected)
        return d

    def stage_forward_now(
        self, tokens: Sequence[int], start: int, end: int, hidden_in: bytes | None
    ) -> StageResult:
        """Run a stage synchronously on the calling thread (tests and benchmarks; not while the
        worker thread is busy)."""
        hidden = None if hidden_in is None else decode_hidden(hidden_in, self._hidden_size)
        return self._runner.stage(list(tokens), start, end, hidden)

    def start(self) -> None:
        if self._started:
            return
        self._started = True
        # The steps' OpenMP team must be the only one (sfnode/engines/kernels/openmp.py): give back
        # the one this thread (the reactor's, which loaded the model) holds.
        log.info("OpenMP threads of the starting thread: {done}", done=openmp.release_team())
        self._pool.start()
        prepare = getattr(self._runner, "prepare_thread", None)
        if prepare is not None:
            self._pool.callInThread(prepare)
        if isinstance(self._runner, LlamaRunner):
            # Before any step (the pool runs one job at a time, in order).
            checking = deferToThreadPool(self._reactor, self._pool, self._runner.check_exactness)
            checking.addCallbacks(self._checked, self._check_failed)
        self._kick()

    def _checked(self, problem: str | None) -> None:
        if problem is None:
            log.info(
                "checked: a position's KV and logits do not depend on how its prompt was cut "
                "into steps, so reused prefixes and failovers continue seeded streams exactly"
            )
        else:
            log.warn(
                "on this machine a position's KV depends on how its prompt was cut into steps "
                "({problem}): a reused prefix or a failover may part from a seeded stream",
                problem=problem,
            )
        self.exactness.callback(problem)

    def _check_failed(self, failure: Failure) -> None:
        log.failure("the start-up check of exactness failed", failure)
        self.exactness.callback(f"the check failed: {failure.value}")

    def stop(self) -> defer.Deferred[None]:
        """Cancel everything, wait for the step in flight, stop the worker thread."""
        done: defer.Deferred[None] = defer.Deferred()
        if self._stopped:
            done.callback(None)
            return done
        self._stop_waiters.append(done)
        if not self._stopping:
            self._stopping = True
            self._deliver([], self._scheduler.abandon())
            if not self._stepping:
                self._stop_pool()
        return done

    def _stop_pool(self) -> None:
        if self._started:
            self._pool.stop()
        if self._grammar_pool.started:
            self._grammar_pool.stop()
        if self._masks is not None:
            self._masks.stop()
        self._stopped = True
        waiters, self._stop_waiters = self._stop_waiters, []
        for waiter in waiters:
            waiter.callback(None)

    # -- steps (reactor thread) -------------------------------------------------------------------

    def _cancel(self, request: Request) -> None:
        self._scheduler.cancel(request)
        self._kick()

    def _kick(self) -> None:
        """Send off the next step if none is running and there is something to do."""
        if self._stepping or self._stopping or not self._started:
            return
        plan, ended = self._scheduler.plan(self._clock(), self._pace.rates)
        if not plan.empty:
            self._stepping = True
            d = deferToThreadPool(self._reactor, self._pool, self._timed_run, plan)
            d.addCallbacks(
                self._step_done, self._step_failed, callbackArgs=(plan,), errbackArgs=(plan,)
            )
            d.addErrback(lambda failure: log.failure("the engine's step handling failed", failure))
        self._deliver([], ended)

    def _timed_run(self, plan: StepPlan) -> tuple[StepOutput, float]:
        """Run ``plan`` (worker thread); answer its output and how long it took."""
        started = time.perf_counter()
        output = self._runner.run(plan)
        return output, time.perf_counter() - started

    @property
    def step_rates(self) -> StepRates:
        """What a step takes here, as measured so far (docs/engine.md section 3)."""
        return self._pace.rates

    def _step_done(self, result: tuple[StepOutput, float], plan: StepPlan) -> None:
        self._stepping = False
        if self._stopping:
            self._stop_pool()
            return
        output, seconds = result
        if plan.decode or plan.chunks:
            self._pace.observe(StepCost.of(plan), seconds)
        emitted, ended = self._scheduler.complete(plan, output)
        self._kick()
        self._deliver(emitted, ended)

    def _step_failed(self, failure: Failure, plan: StepPlan) -> None:
        self._stepping = False
        if self._stopping:
            self._stop_pool()
            return
        log.failure(
            "an engine step failed; its {n} generations fail, the engine keeps serving",
            failure,
            n=len(plan.decode) + len(plan.chunks),
        )
        error = failure.value if failure.value is not None else RuntimeError("step failed")
        ended = self._scheduler.fail(plan, error)
        self._kick()
        self._deliver([], ended)

    def _deliver(self, emitted: Sequence[Emitted], ended: Sequence[Ended]) -> None:
        """Hand tokens to their generations (one call per generation per step), then ends."""
        batches: dict[int, tuple[_Generation, list[int], list[TokenLogprob]]] = {}
        for request, token, logprob in emitted:
            handle: _Generation = request.handle
            _, tokens, logprobs = batches.setdefault(id(handle), (handle, [], []))
            tokens.append(token)
            if logprob is not None:
                logprobs.append(logprob)
        for handle, tokens, logprobs in batches.values():
            asked = handle.request is not None and handle.request.params.logprobs > 0
            handle._deliver(tokens, logprobs if asked else None)
        for request, stop, error in ended:
            handle = request.handle
            if error is not None:
                handle._fail(error)
            else:
                assert stop is not None
                handle._finish(stop)


if TYPE_CHECKING:

    def _conforms(engine: TransformersEngine, generation: _Generation) -> tuple[Engine, Generation]:
        """mypy checks here that the engine and its handle implement the node's protocols."""
        return engine, generation
