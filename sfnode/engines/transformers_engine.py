"""The transformers engine: the engine loop with a model runner on one worker thread.

It is :class:`~sfnode.engines.loop.EngineLoop` (docs/engine.md section 3), the loop the mock engine
runs too, with:

- a model runner that executes each step's plan, one forward pass, and samples:
  :class:`~sfnode.engines.runners.decoder.DecoderRunner` over the model as stored (a
  :class:`~sfnode.engines.weights.stored.StoredModel`, or a transformers model's own arrays), for
  every family sfnode reads (docs/engine.md section 5.4), or with ``--stock-kernels``
  :class:`~sfnode.engines.runners.forward.ModelForwardRunner`, a transformers model's own
  forward;
- :class:`ThreadWorker`, which runs the runner on a one-thread pool with ``deferToThreadPool``
  (the output comes back as a Deferred on the reactor), prepares constrained requests on a
  thread of its own, and checks at start that a position's KV does not depend on how its prompt
  was cut into steps.

Speculative decoding (``speculative="ngram"``, docs/engine.md section 3.1): the scheduler drafts
each decoding lane's next tokens from its own context, the decoder runner verifies them in the same
pass, and the sampler's own rule keeps those it would have drawn; the model-forward runner does
not speculate.

Constraints (docs/engine.md section 2.4): with the model's tokenizer the engine builds a
:class:`~sfnode.decoding.constraint.Vocabulary`; a constrained request's
:class:`~sfnode.decoding.constraint.LaneStage` is prepared (its grammar compiled, delivered tokens
replayed) on a thread of its own before the request queues, and each step's masks are computed
by a :class:`~sfnode.engines.runners.masks.MaskWorker` while the step's forward pass runs.

This module must never touch the model except through the runner on the worker thread, and never
sample with a random generator (:mod:`sfnode.decoding.sampler` does every draw).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from twisted.internet import defer
from twisted.internet.interfaces import IDelayedCall
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.python.threadpool import ThreadPool

from sfnode.decoding.constraint import Vocabulary
from sfnode.engines.config import DEFAULT_ENGINE_CONFIG, EngineConfig
from sfnode.engines.families.spec import ModelSpec
from sfnode.engines.kernels import openmp
from sfnode.engines.kernels.choice import Cpu
from sfnode.engines.loop import EngineLoop, RunnerTraits, prefix_pool_blocks
from sfnode.engines.runners.decoder import DecoderRunner
from sfnode.engines.runners.exactness import ExactnessCheck
from sfnode.engines.runners.hidden import decode_hidden, encode_hidden
from sfnode.engines.runners.masks import MaskWorker
from sfnode.engines.runners.stages import DecoderStages
from sfnode.engines.scheduling.plan import StepOutput, StepPlan
from sfnode.engines.weights import packed
from sfnode.engines.weights.gather import ModelWeights, WeightsError, as_stored, gather_weights
from sfnode.engines.weights.loading import LoadedModel
from sfnode.engines.weights.stored import StoredModel
from sfnode.generation import EngineStatistics, MaskFigures, StageResult, WeightFigures
from sfnode.linkf.heap import libc_function, trim_heap
from sfnode.linkf.prefix_blocks import KV_BLOCK_TOKENS

if TYPE_CHECKING:
    from sfnode.generation import Engine

__all__ = ["TransformersEngine", "decode_hidden", "encode_hidden", "eos_ids_of"]

log = Logger(namespace="sfnode.engines.transformers")

T = TypeVar("T")

CHECK_AFTER_S = 1.0
"""The start-up check of exactness begins after the first step, or this long after the engine
started when no step came first (docs/engine.md section 4.1)."""
REST_AFTER_S = 1.0
"""Seconds an engine is out of work before it gives back what only steps need: a chat's next
request, sent as the last answer ends, finds the pages still there."""

if TYPE_CHECKING:
    # The model's own forward imports transformers: only --stock-kernels loads it.
    from sfnode.engines.runners.forward import ModelForwardRunner

    TorchRunner = DecoderRunner | ModelForwardRunner


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


HEAP_THRESHOLD = 128 * 1024
"""glibc's threshold (bytes) above which an allocation is a map of its own, returned to the
system when freed, and above which the heap's free top is returned (``mallopt``'s
``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD``): glibc's own first value of both, kept."""
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def _bound_heap() -> None:
    """Keep glibc's heap thresholds at :data:`HEAP_THRESHOLD` (nothing where the C library is
    not glibc).  Left alone, glibc raises them each time a large map of its own is freed (up to
    32 MB, and the trim threshold to twice that), as packing the weights at start does: a
    step's large temporaries then come from the heap, and what they free stays resident until
    the engine rests (``malloc_trim``), 20-30 MB on the files of ``bench/sizes.py``
    (docs/engine.md section 5.3).  Set, they never move: a large temporary is mapped and
    unmapped by itself."""
    mallopt = libc_function("mallopt")
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, HEAP_THRESHOLD)
        mallopt(_M_TRIM_THRESHOLD, HEAP_THRESHOLD)


def _rest(runner: TorchRunner) -> None:
    """What :meth:`ThreadWorker.rest` runs on the worker thread."""
    if isinstance(runner, DecoderRunner):
        runner.weights.give_back_rows()
    trim_heap()


def _kept_stages(
    runner: TorchRunner, config: EngineConfig, traits: RunnerTraits
) -> DecoderStages | None:
    """Stages keep their KV where sfnode's own step runs (docs/protocol.md section 12.8), in
    as many sessions as the node has lanes, with a prefix pool as large as the lanes' own."""
    if not isinstance(runner, DecoderRunner):
        return None
    return DecoderStages(runner, config.max_lanes, prefix_pool_blocks(config, traits), traits.salt)


class ThreadWorker:
    """Where the transformers engine's runner executes: steps and pipeline stages on one
    worker thread, in order; constrained requests' stages prepared on another (compiling a
    grammar can take 100 ms)."""

    def __init__(
        self,
        reactor: Any,
        runner: TorchRunner,
        masks: MaskWorker | None,
        kept: KeptCheck | None = None,
    ) -> None:
        self._reactor = reactor
        self._runner = runner
        self._masks = masks
        self._kept = kept
        self._check_timer: IDelayedCall | None = None
        self._rest_timer: IDelayedCall | None = None
        self._pool = ThreadPool(minthreads=1, maxthreads=1, name="sfnode-engine")
        self._grammar_pool = ThreadPool(minthreads=0, maxthreads=1, name="sfnode-grammar")
        self.exactness: defer.Deferred[str | None] = defer.Deferred()
        """Fires once the start-up check has run (decoder runner only): with None when a
        position's KV does not depend on how its prompt is cut into steps and the check
        computed what it computed at the first start of this file with this engine, else what
        differed (docs/engine.md section 4.1)."""

    def start(self) -> None:
        # The steps' OpenMP team must be the only one (sfnode/engines/kernels/openmp.py): give
        # back the one this thread (the reactor's, which loaded the model) holds.
        log.info("OpenMP threads of the starting thread: {done}", done=openmp.release_team())
        self._pool.start()
        prepare = getattr(self._runner, "prepare_thread", None)
        if prepare is not None:
            self._pool.callInThread(prepare)
        if isinstance(self._runner, DecoderRunner):
            self._check_timer = self._reactor.callLater(CHECK_AFTER_S, self._begin_check)

    def _begin_check(self) -> None:
        """Off the path to the first token: one piece at a time on the worker thread, so a
        step sent meanwhile runs between two pieces."""
        self._check_timer = None
        check = self.call(ExactnessCheck, self._runner)
        check.addCallback(self._next_piece, 0)
        check.addCallbacks(self._checked, self._check_failed)

    def _next_piece(self, check: ExactnessCheck, index: int) -> Any:
        """Queue piece ``index`` of ``check`` (the next one once it ran); its verdict last."""
        if index == len(check.pieces):
            return self._verdict(check)
        running = self.call(check.pieces[index])
        return running.addCallback(lambda _: self._next_piece(check, index + 1))

    def _verdict(self, check: ExactnessCheck) -> str | None:
        """The check's verdict, and its digest against the one kept at the first start."""
        problem = check.verdict()
        if problem is not None and _cut_by_choice(self._runner):
            log.warn(
                "with dense copies for long prompt chunks a position's KV depends on how its "
                "prompt was cut into steps ({problem}): a reused prefix or a failover may part "
                "from a seeded stream (docs/engine.md section 5)",
                problem=problem,
            )
            problem = None
        if problem is not None or self._kept is None:
            return problem
        kept = packed.kept_digest(self._kept.folder, self._kept.key)
        if kept is None:
            packed.keep_digest(self._kept.folder, self._kept.key, check.digest)
        elif kept != check.digest:
            where = self._kept.folder / packed.EXACTNESS_FILE
            return (
                "the check's keys, values or logits differ from those this file gave at its "
                f"first start with this engine (kept in {where})"
            )
        return None

    def step(self, plan: StepPlan) -> defer.Deferred[tuple[StepOutput, float]]:
        self._cancel_rest()
        running = self.call(self._timed_run, plan)
        if self._check_timer is not None:
            # The first step goes first; the check follows it.
            self._check_timer.cancel()
            self._begin_check()
        return running

    def _timed_run(self, plan: StepPlan) -> tuple[StepOutput, float]:
        """Run ``plan`` (worker thread); answer its output and how long it took."""
        started = time.perf_counter()
        output = self._runner.run(plan)
        return output, time.perf_counter() - started

    def call(self, work: Callable[..., T], *args: Any) -> defer.Deferred[T]:
        return deferToThreadPool(self._reactor, self._pool, work, *args)

    def compile_grammar(self, work: Callable[..., T], *args: Any) -> defer.Deferred[T]:
        """On the grammars' own thread (started at the first), so a slow grammar never holds
        the steps back."""
        if not self._grammar_pool.started:
            self._grammar_pool.start()
        return deferToThreadPool(self._reactor, self._grammar_pool, work, *args)

    def rest(self) -> None:
        """:data:`REST_AFTER_S` from now unless a step is sent first, on the worker thread:
        the file's pages of the rows the steps read (embeddings, the head's float rows) and
        the heap's free pages go back to the system (docs/engine.md section 5.3)."""
        if self._rest_timer is None and self._pool.started:
            self._rest_timer = self._reactor.callLater(REST_AFTER_S, self._rest_now)

    def _rest_now(self) -> None:
        self._rest_timer = None
        if self._pool.started:
            rested = self.call(_rest, self._runner)
            rested.addErrback(lambda failure: log.failure("giving back memory failed", failure))

    def _cancel_rest(self) -> None:
        if self._rest_timer is not None:
            self._rest_timer.cancel()
            self._rest_timer = None

    def interrupt(self) -> None:
        """A step on the thread cannot be stopped: the loop waits for it."""

    def stop(self) -> None:
        self._cancel_rest()
        if self._check_timer is not None:
            self._check_timer.cancel()
            self._check_timer = None
        if self._pool.started:
            self._pool.stop()
        if self._grammar_pool.started:
            self._grammar_pool.stop()
        if self._masks is not None:
            self._masks.stop()

    def _checked(self, problem: str | None) -> None:
        if problem is None:
            log.info(
                "checked: a position's KV and logits do not depend on how its prompt was cut "
                "into steps, so reused prefixes and failovers continue seeded streams exactly"
            )
        else:
            log.error(
                "the start-up check of exactness failed ({problem}): a reused prefix or a "
                "failover may part from a seeded stream, so the node withdraws",
                problem=problem,
            )
        self.exactness.callback(problem)
        # The check read rows of the file's tables and left heap behind.
        self.rest()

    def _check_failed(self, failure: Failure) -> None:
        log.failure("the start-up check of exactness failed", failure)
        self.exactness.callback(f"the check failed: {failure.value}")


def _cut_by_choice(runner: TorchRunner) -> bool:
    """Whether the runner keeps dense copies for long prompt chunks: then a position's KV
    depends on its chunk by the configuration's choice, and the check's split is no failure
    (docs/engine.md section 5)."""
    return isinstance(runner, DecoderRunner) and runner.weights.dense_rows is not None


def vocabulary_of(tokenizer: Any, size: int, eos_ids: frozenset[int]) -> Vocabulary | None:
    """The grammar library's view of ``tokenizer``; None (and a log line) when it has none."""
    if tokenizer is None:
        return None
    try:
        vocabulary = Vocabulary.of_tokenizer(tokenizer, size=size, eos_ids=eos_ids)
    except ValueError as e:
        # A slow tokenizer, or a model without an EOS id: served without constraints.
        log.warn("constraints are not available with this model: {error}", error=str(e))
        return None
    log.info(
        "constraints: the grammar library reads the {n} tokens when a constraint first needs them",
        n=size,
    )
    return vocabulary


@dataclass(frozen=True)
class KeptCheck:
    """Where the start-up check of exactness keeps its digest (the folder of the model's packed
    weights), and under which key (docs/engine.md section 4.1)."""

    folder: Path
    key: str

    @classmethod
    def of(cls, config: EngineConfig, weights: ServedWeights) -> KeptCheck | None:
        """For a decoder runner whose packed weights are kept (``config.weights_cache``)."""
        runner = weights.runner
        if config.weights_cache is None or not isinstance(runner, DecoderRunner):
            return None
        key = "|".join(
            (
                packed.engine_version(),
                Cpu.here().key(),
                weights.mode,
                weights.kernels,
                "native step" if runner.fused is not None else "torch operators",
            )
        )
        return cls(config.weights_cache.parent, key)


@dataclass(frozen=True)
class ServedWeights:
    """How the engine's runner holds and multiplies the weights."""

    runner: TorchRunner
    mode: str
    """The weights mode served (``int4``, ``float32``, ...)."""
    kernels: str
    """A short account of the kernels, for the log and the tests."""
    activations: torch.dtype
    onednn_layers: int = 0
    gathered: ModelWeights | None = None
    """The decoder runner's weights (None: the model's own forward holds them)."""
    figures: WeightFigures | None = None
    """What the decoder runner's weights take against their files (None: the model's own
    forward)."""


def decoder_runner(
    stored: StoredModel,
    config: EngineConfig,
    window: int,
    masks: MaskWorker | None,
    float_dtype: torch.dtype,
    device: torch.device,
) -> ServedWeights:
    """sfnode's own step over the model as stored."""
    _, kv_blocks = config.kv_sizes(stored.spec.context_length)
    pool_blocks = config.prefix_blocks(kv_blocks)
    served = gather_weights(
        stored,
        config.weights,
        float_dtype=float_dtype,
        device=device,
        cache_file=config.weights_cache,
        dense_copies=config.dense_copies,
        kernels=config.kernels,
        fused_step=config.fused_step,
    )
    runner = DecoderRunner(
        served,
        slots=config.max_lanes,
        window=window,
        pool_blocks=pool_blocks,
        fused=config.fused_step,
        masks=masks,
    )
    figures = WeightFigures(served.held_bytes(), stored.file_bytes)
    log.info(
        "serving {layers} layers of {family} with weights {mode} ({kernels}; {held:.1f} MB held "
        "for {file:.1f} MB of files, {ratio:.2f}x); activations and KV in {dtype}; prefix cache "
        "{prefix}; {fused}",
        layers=len(served.layers),
        family=stored.spec.family,
        mode=served.mode,
        kernels=served.describe(),
        held=figures.held_bytes / 1e6,
        file=figures.file_bytes / 1e6,
        ratio=figures.ratio,
        dtype=str(served.activations).removeprefix("torch."),
        prefix=f"{pool_blocks} blocks" if pool_blocks else "off",
        fused=(
            "the whole step (layers, attention, head) in two native calls"
            if runner.fused is not None
            else f"layers run as torch operators (no native step: {runner.fused_reason})"
        ),
    )
    return ServedWeights(
        runner,
        served.mode,
        served.describe(),
        served.activations,
        gathered=served,
        figures=figures,
    )


def forward_runner(
    model: Any, config: EngineConfig, masks: MaskWorker | None, why: str
) -> ServedWeights:
    """The model's own forward (``why``: the reason sfnode's step does not serve it).

    :raises WeightsError: the configuration asks for weights only sfnode's step serves."""
    dtype = next(model.parameters()).dtype
    if config.weights not in ("auto", str(dtype).removeprefix("torch.")):
        raise WeightsError(
            f"--weights {config.weights} needs sfnode's own step, which does not serve this "
            f"model ({why}); its own forward serves {dtype} weights"
        )
    from sfnode.engines.runners.forward import ModelForwardRunner

    runner = ModelForwardRunner(model, onednn=config.onednn, masks=masks)
    log.info(
        "serving through the model's own forward ({why}); {layers} linear layers on oneDNN",
        why=why,
        layers=runner.onednn_layers,
    )
    return ServedWeights(
        runner,
        str(dtype).removeprefix("torch."),
        f"the model's own forward ({runner.onednn_layers} layers on oneDNN)",
        dtype,
        onednn_layers=runner.onednn_layers,
    )


def _model_figures(
    stored: StoredModel | None, model: Any
) -> tuple[frozenset[int], int, int, int, int]:
    """(end-of-sequence ids, vocabulary size, hidden size, context length, layers) of the
    model as stored, or of the transformers model object when ``stored`` is None."""
    if stored is not None:
        spec = stored.spec
        return (
            frozenset(spec.eos_ids),
            spec.vocab_size,
            spec.hidden,
            spec.context_length,
            spec.layers,
        )
    config = model.config
    return (
        eos_ids_of(model),
        int(getattr(config, "vocab_size", 0)),
        int(getattr(config, "hidden_size", 0)),
        int(getattr(config, "max_position_embeddings", 0) or 0),
        int(getattr(config, "num_hidden_layers", 0)),
    )


def kv_block_bytes(spec: ModelSpec) -> int:
    """Bytes of one KV block (16 positions, every layer's keys and values), counted in float32,
    the widest keys and values sfnode holds."""
    return spec.layers * 2 * spec.kv_heads * KV_BLOCK_TOKENS * spec.head_dim * 4


class TransformersEngine(EngineLoop):
    """An :class:`sfnode.generation.Engine` over a model as stored, or over a transformers
    causal LM (see the module)."""

    def __init__(
        self,
        model: Any,
        reactor: Any,
        config: EngineConfig = DEFAULT_ENGINE_CONFIG,
        *,
        tokenizer: Any = None,
        clock: Callable[[], float] = time.monotonic,
        float_dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> None:
        """``model`` is a :class:`StoredModel` or a transformers causal LM (its own forward
        serves it with ``--stock-kernels``, ``config.lean_step`` false, which only a model object
        has).  ``tokenizer`` (the model's transformers fast tokenizer) lets it honour
        constraints (docs/engine.md section 2.4); without one, ``supports_constraints`` is
        false.  ``clock`` reads the seconds deadlines are kept in.  ``float_dtype`` and
        ``device``: what ``--weights auto`` makes of float matrices and where the weights live
        (a model object's own by default; float32 on the CPU for a stored model).

        :raises ValueError: the configuration does not fit the model.
        :raises WeightsError: the weights cannot be served as the configuration asks."""
        stored = model if isinstance(model, StoredModel) else None
        if stored is None:
            parameter = next(model.parameters())
            float_dtype, device = float_dtype or parameter.dtype, device or parameter.device
        elif not config.lean_step:
            raise ValueError("the model's own forward (--stock-kernels) needs its model object")
        if config.lean_step:
            stored = stored or as_stored(model)
        eos_ids, vocab_size, self._hidden_size, model_window, n_layers = _model_figures(
            stored if config.lean_step else None, model
        )
        eos_ids = config.eos_ids if config.eos_ids is not None else eos_ids
        if stored is not None and config.lean_step:
            config = config.within_memory(kv_block_bytes(stored.spec), model_window)
        window, _ = config.kv_sizes(model_window)
        vocabulary = vocabulary_of(tokenizer, vocab_size, eos_ids)
        self._masks = masks = MaskWorker(vocabulary) if vocabulary is not None else None
        why = None if config.lean_step else "--stock-kernels"
        if stored is not None and config.lean_step:
            float_dtype, device = float_dtype or torch.float32, device or torch.device("cpu")
            weights = decoder_runner(stored, config, window, masks, float_dtype, device)
        else:
            weights = forward_runner(model, config, masks, "--stock-kernels")
        self.weights = weights
        traits = RunnerTraits(
            n_layers=n_layers, vocab_size=vocab_size, eos_ids=eos_ids, model_window=model_window,
            salt=f"{weights.mode}|{weights.activations}|{n_layers}".encode(),
            block_copies=why is None, drafts=why is None,
        )  # fmt: skip
        self._worker = ThreadWorker(reactor, weights.runner, masks, KeptCheck.of(config, weights))
        super().__init__(
            config, traits, weights.runner, self._worker, clock=clock, vocabulary=vocabulary,
            stages=_kept_stages(weights.runner, config, traits),
        )  # fmt: skip
        # First of the check's callbacks: the engine refuses work before anyone hears of it.
        self._worker.exactness.addCallback(self._withdraw_on_failure)
        self._log_speculation(why)

    def _withdraw_on_failure(self, problem: str | None) -> str | None:
        """A failed start-up check withdraws the engine: it refuses all work from then on
        (docs/engine.md section 4.1; the node stops offering its model, D25)."""
        if problem is not None:
            self.refusal = problem
        return problem

    def _log_speculation(self, why: str | None) -> None:
        if self.config.speculative != "ngram":
            return
        speculation = self.speculation
        if speculation is None:
            log.warn(
                "speculative decoding is off: the model's own forward does not verify drafts "
                "({why})",
                why=why,
            )
            return
        log.info(
            "speculative decoding: up to {k} tokens a lane per step, drafted from "
            "{low}- to {high}-grams of its own context",
            k=speculation.draft_tokens,
            low=speculation.ngram_min,
            high=speculation.ngram_max,
        )

    @classmethod
    def from_loaded(
        cls, loaded: LoadedModel, reactor: Any, config: EngineConfig = DEFAULT_ENGINE_CONFIG
    ) -> TransformersEngine:
        """An engine over a model from :func:`sfnode.engines.weights.loading.load_model`, with
        its tokenizer; the weights of a GGUF file converted for a kernel are kept beside its
        model files (the file's own blocks are read from the file at every start)."""
        if loaded.cache_file is not None:
            config = replace(config, weights_cache=config.weights_cache or loaded.cache_file)
        _bound_heap()
        engine = cls(
            loaded.stored,
            reactor,
            config,
            tokenizer=loaded.tokenizer_json,
            float_dtype=loaded.dtype,
            device=loaded.device,
        )
        # Give the heap back what packing and measuring at start left of it.
        trim_heap()
        return engine

    # -- what tests, benchmarks and the node's figures read -----------------------------------

    @property
    def lean_step(self) -> bool:
        """Whether steps run through :class:`DecoderRunner` rather than the model's forward."""
        return isinstance(self.runner, DecoderRunner)

    @property
    def fused_step(self) -> bool:
        """Whether the whole step runs in sfnode's native fused calls."""
        return isinstance(self.runner, DecoderRunner) and self.runner.fused is not None

    @property
    def exactness(self) -> defer.Deferred[str | None]:
        """See :attr:`ThreadWorker.exactness`."""
        return self._worker.exactness

    @property
    def path(self) -> str:
        """``native step, q4_1 weights``, ``torch operators, float32 weights`` or ``the model's
        own forward, float32 weights``."""
        runner = self.weights.runner
        if not isinstance(runner, DecoderRunner):
            step = "the model's own forward"
        else:
            step = "native step" if runner.fused is not None else "torch operators"
        return f"{step}, {self.weights.mode} weights"

    def statistics(self) -> EngineStatistics:
        """The loop's figures, the weights held against their files, and the bytes of keys
        and values allocated (the lanes' slots and the prefix cache's pool)."""
        runner = self.runner
        kv_bytes = None
        if isinstance(runner, DecoderRunner):
            kv_bytes = runner.kv.nbytes + (runner.pool.nbytes if runner.pool is not None else 0)
        figures, gathered = self.weights.figures, self.weights.gathered
        if figures is not None and gathered is not None:
            figures = replace(figures, resident_bytes=gathered.resident_bytes())
        return replace(super().statistics(), weights=figures, kv_bytes=kv_bytes)

    def mask_figures(self) -> MaskFigures | None:
        if self._masks is None:
            return None
        return MaskFigures(*self._masks.figures())

    # -- pipeline stages ----------------------------------------------------------------------

    def read_hidden(self, blob: bytes) -> torch.Tensor:
        """A D5 hidden blob (docs/protocol.md section 7.6) as a tensor."""
        return decode_hidden(blob, self._hidden_size)

    def stage_forward_now(
        self, tokens: Sequence[int], start: int, end: int, hidden_in: bytes | None
    ) -> StageResult:
        """Run a stage synchronously on the calling thread (tests and benchmarks; not while the
        worker thread is busy)."""
        hidden = None if hidden_in is None else self.read_hidden(hidden_in)
        return self.weights.runner.stage(list(tokens), start, end, hidden)


if TYPE_CHECKING:

    def _conforms(engine: TransformersEngine) -> Engine:
        """mypy checks here that the engine implements the node's protocol."""
        return engine
