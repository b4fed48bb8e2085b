"""The transformers engine: continuous batching in lanes over a causal LM, on one worker thread.

One worker thread owns the model.  Up to ``max_lanes`` generations decode together, one forward pass
per step over all decoding lanes (ENGINE.md section 3).  The decoding lanes share one padded KV
cache (a transformers ``DynamicCache`` whose layers grow in place, rows left-padded to a common
length, with a 2D attention mask and explicit position ids).  A new request is prefilled into its
own cache in chunks of ``prefill_chunk`` tokens, one chunk per step, and is then merged into the
batch; lanes that finish or are cancelled leave between steps, and the common left padding is
trimmed away.  KV memory is accounted in 16-token blocks; a request is admitted only when the
blocks it may need (``ceil(min(context + max_new, window) / 16)``) fit in the pool, otherwise it
waits in the queue.

Three things make a step cheaper on a CPU without changing what it computes: the worker runs
float32 linear layers on oneDNN rather than MKL (:mod:`sfnode.engines.kernels`); plain Llama
models decode through :class:`sfnode.engines.llama_step.LlamaStep`, the model's arithmetic
without transformers' per-layer machinery; and with that step a prompt chunk rides along with the
running lanes' decode step, so the weights (most of a step's cost) are read once for both.  Any
other model runs through its own forward, prefill and decode separately.

Stage forwards (LINKF 6.6 with decision D5) run on the same worker thread, between steps, for
Llama-family models.

This module must never call back into the node from the worker thread: every token batch, result
and failure crosses to the reactor through ``reactor.callFromThread`` and nothing else.  It must
never let one generation's error stop the engine, and never sample with a random generator (the
counter-based sampler of :mod:`sfnode.sampler` does every draw).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

# OpenMP threads that spin at barriers slow a decode step down 20 to 40 times when another busy
# process shares these two cores; sleeping waits cost next to nothing.  It only takes effect if
# torch is not imported yet (the node's entry point should set it too).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import msgpack
import torch
from twisted.internet import defer
from twisted.internet.interfaces import IReactorFromThreads
from twisted.logger import Logger

from sfnode.engines.kernels import lane_cache, onednn_on_this_thread, use_onednn_linear
from sfnode.engines.llama_step import LlamaStep
from sfnode.generation import (
    KV_BLOCK_TOKENS,
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
    TokenSink,
)
from sfnode.models import LoadedModel
from sfnode.sampler import draw_position, sample_tokens
from sfnode.wire import GenParams

log = Logger(namespace="sfnode.engines.transformers")

_BLOB_DTYPES: dict[str, torch.dtype] = {
    "f32": torch.float32,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
}
_DTYPE_NAMES = {v: k for k, v in _BLOB_DTYPES.items()}


def _blocks(tokens: int) -> int:
    return -(-tokens // KV_BLOCK_TOKENS)


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


def encode_hidden(hidden: torch.Tensor) -> bytes:
    """A ``[n_tokens, hidden_size]`` tensor as the D5 blob ``[dtype, [n, h], bin]``."""
    name = _DTYPE_NAMES.get(hidden.dtype)
    if name is None:
        hidden = hidden.to(torch.float32)
        name = "f32"
    n, h = hidden.shape
    raw = hidden.contiguous().cpu().view(torch.uint8).numpy().tobytes()
    packed: bytes = msgpack.packb([name, [int(n), int(h)], raw], use_bin_type=True)
    return packed


def decode_hidden(blob: bytes, hidden_size: int) -> torch.Tensor:
    """The tensor of a D5 blob; :class:`StageForwardError` for anything malformed."""
    try:
        value = msgpack.unpackb(blob, raw=False)
    except Exception as e:
        raise StageForwardError(f"hidden blob is not msgpack: {e}") from e
    if not (isinstance(value, list) and len(value) == 3):
        raise StageForwardError("hidden blob must be [dtype, [n_tokens, hidden_size], bin]")
    name, shape, raw = value
    dtype = _BLOB_DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise StageForwardError(f"hidden blob dtype {name!r} is not one of f32, f16, bf16")
    if not (
        isinstance(shape, list)
        and len(shape) == 2
        and all(isinstance(d, int) and not isinstance(d, bool) for d in shape)
    ):
        raise StageForwardError("hidden blob shape must be [n_tokens, hidden_size]")
    n, h = shape
    if h != hidden_size:
        raise StageForwardError(f"hidden size {h} does not match the model's {hidden_size}")
    if n <= 0:
        raise StageForwardError(f"hidden blob holds {n} tokens")
    if not isinstance(raw, bytes):
        raise StageForwardError("hidden blob data must be bytes")
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(raw) != n * h * itemsize:
        raise StageForwardError(
            f"hidden blob holds {len(raw)} bytes, expected {n * h * itemsize} for {n}x{h} {name}"
        )
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(n, h)


def _dispatch_tokens(batch: Sequence[tuple[_Generation, int]]) -> None:
    """Reactor side of one step's tokens: each handle gets its token, in step order."""
    for handle, token in batch:
        handle._deliver([token])


class _Generation:
    """The node's handle on one generation; lives on the reactor thread."""

    def __init__(self, engine: TransformersEngine, on_tokens: TokenSink) -> None:
        self._engine = engine
        self._on_tokens = on_tokens
        self._delivered: list[int] = []
        self._cancelled = False
        self._result: defer.Deferred[GenerationResult] = defer.Deferred(lambda _d: self.cancel())
        self.job: _Job | None = None

    @property
    def result(self) -> defer.Deferred[GenerationResult]:
        return self._result

    def cancel(self) -> None:
        if self._result.called or self._cancelled:
            return
        self._cancelled = True
        if self.job is not None:
            self.job.cancel_requested = True
            self._engine._wake()

    def _deliver(self, tokens: list[int]) -> None:
        if self._result.called or self._cancelled:
            return
        self._delivered.extend(tokens)
        try:
            self._on_tokens(tokens)
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


@dataclass(eq=False)
class _Job:
    """A request as the worker sees it.  Only ``cancel_requested`` is written by the reactor."""

    handle: _Generation
    context: list[int]
    params: GenParams
    max_new: int
    deadline: float | None
    reserve_blocks: int
    token_limit: int
    eos_ids: frozenset[int]
    cancel_requested: bool = False


@dataclass(eq=False)
class _Lane:
    """An admitted job: its prefill progress, own cache while prefilling, and its new tokens."""

    job: _Job
    cache: Any = None
    # Whether its prompt chunks may share a pass with decode steps (see _admit).
    mixable: bool = False
    prefilled: int = 0
    generated: list[int] = field(default_factory=list)
    next_input: int = 0

    @property
    def tokens(self) -> int:
        return len(self.job.context) + len(self.generated)


@dataclass(eq=False)
class _StageJob:
    tokens: list[int]
    start: int
    end: int
    hidden_in: bytes | None
    result: defer.Deferred[StageResult]


class TransformersEngine:
    """An :class:`sfnode.generation.Engine` over a transformers causal LM (continuous batching)."""

    def __init__(
        self,
        model: Any,
        reactor: IReactorFromThreads,
        *,
        max_lanes: int = 8,
        kv_blocks: int | None = None,
        context_window: int | None = None,
        prefill_chunk: int = 128,
        eos_ids: Sequence[int] | None = None,
        onednn: bool = True,
        lean_step: bool = True,
    ) -> None:
        """``onednn`` routes the model's float32 CPU linear layers to oneDNN on the worker
        thread; ``lean_step`` decodes plain Llama models through :class:`LlamaStep` (and fuses
        prompt chunks into decode steps).  Both are on by default; with both off the engine runs
        stock transformers, which is slower and computes the same tokens."""
        if max_lanes < 1:
            raise ValueError("max_lanes must be at least 1")
        self._model = model
        self._reactor = reactor
        self._config = model.config
        self._device: torch.device = next(model.parameters()).device
        self._max_lanes = max_lanes
        self._prefill_chunk = max(1, prefill_chunk)
        model_window = int(getattr(self._config, "max_position_embeddings", 0) or 0)
        window = model_window
        if context_window:
            window = min(window, context_window) if window else context_window
        if window <= 0:
            raise ValueError("the model has no max_position_embeddings; pass context_window")
        self._kv_blocks_total = kv_blocks if kv_blocks is not None else _blocks(window) * max_lanes
        if self._kv_blocks_total < 1:
            raise ValueError("kv_blocks must be at least 1")
        self._window = min(window, self._kv_blocks_total * KV_BLOCK_TOKENS)
        self._eos_ids = frozenset(eos_ids) if eos_ids is not None else eos_ids_of(model)
        self._n_layers = int(getattr(self._config, "num_hidden_layers", 0))
        self._vocab_size = int(getattr(self._config, "vocab_size", 0))
        # The worker runs float32 CPU linear layers on oneDNN (sfnode.engines.kernels says why).
        self._onednn_layers = use_onednn_linear(model) if onednn else 0
        # Plain Llama models decode through a lean step (sfnode.engines.llama_step says why).
        self._llama_step = LlamaStep.for_model(model) if lean_step else None
        if self._onednn_layers:
            log.info(
                "the engine worker runs {layers} linear layers on oneDNN",
                layers=self._onednn_layers,
            )

        self._cond = threading.Condition()
        # Guarded by _cond:
        self._incoming: deque[_Job] = deque()
        self._stage_queue: deque[_StageJob] = deque()
        self._stopping = False
        # Worker-owned:
        self._waiting: deque[_Job] = deque()
        self._prefilling: list[_Lane] = []
        self._batch: list[_Lane] = []
        self._cache: Any = None
        self._pad: list[int] = []
        self._reserved_blocks = 0
        # New tokens of this step, posted to the reactor in one call per step:
        self._outbox: list[tuple[_Generation, int]] = []
        # Ends of generations, posted after the statistics say their lanes are gone:
        self._ends: list[tuple[Any, Any]] = []
        # Published by the worker, read by statistics():
        self._decoded = 0
        self._prefilled = 0
        self._kv_used = 0
        self._lanes_active = 0
        self._waiting_count = 0

        self._thread: threading.Thread | None = None
        self._stop_waiters: list[defer.Deferred[None]] = []
        self._worker_gone = False

    @classmethod
    def from_loaded(
        cls, loaded: LoadedModel, reactor: IReactorFromThreads, **kwargs: Any
    ) -> TransformersEngine:
        """An engine over a model from :func:`sfnode.models.load_model` (same keywords)."""
        return cls(loaded.model, reactor, **kwargs)

    # -- the Engine interface (reactor thread) -----------------------------------------------

    @property
    def context_window(self) -> int:
        return self._window

    @property
    def n_layers(self) -> int:
        return self._n_layers

    @property
    def onednn_layers(self) -> int:
        """How many of the model's linear layers the worker runs on oneDNN (0: stock PyTorch)."""
        return self._onednn_layers

    @property
    def lean_step(self) -> bool:
        """Whether decode steps run through :class:`LlamaStep` rather than the model's forward."""
        return self._llama_step is not None

    @property
    def max_lanes(self) -> int:
        return self._max_lanes

    @property
    def eos_ids(self) -> frozenset[int]:
        return self._eos_ids

    def statistics(self) -> EngineStatistics:
        with self._cond:
            incoming = len(self._incoming)
            return EngineStatistics(
                decoded_tokens=self._decoded,
                prefilled_tokens=self._prefilled,
                queue_depth=incoming + self._waiting_count,
                lanes_active=self._lanes_active,
                kv_blocks_used=self._kv_used,
                kv_blocks_total=self._kv_blocks_total,
            )

    def submit(self, request: GenerationRequest, on_tokens: TokenSink) -> _Generation:
        handle = _Generation(self, on_tokens)
        context = [int(t) for t in request.context]
        if not context:
            handle._fail(EngineRefusal("the context is empty; there is nothing to extend"))
            return handle
        if len(context) > self._window:
            handle._fail(StreamTooLong(len(context), self._window))
            return handle
        if self._stopping:
            handle._fail(RuntimeError("the engine is stopped"))
            return handle
        if request.max_new <= 0 or len(context) >= self._window:
            handle._finish(EngineStop.LENGTH)
            return handle
        limit = min(len(context) + request.max_new, self._window)
        reserve = min(_blocks(limit), self._kv_blocks_total)
        deadline = (
            time.monotonic() + request.max_wall_ms / 1000.0 if request.max_wall_ms > 0 else None
        )
        job = _Job(
            handle=handle,
            context=context,
            params=request.params,
            max_new=request.max_new,
            deadline=deadline,
            reserve_blocks=reserve,
            token_limit=min(limit, reserve * KV_BLOCK_TOKENS),
            eos_ids=self._eos_ids,
        )
        handle.job = job
        with self._cond:
            self._incoming.append(job)
            self._cond.notify()
        return handle

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
        if self._stopping:
            return defer.fail(StageForwardError("the engine is stopped"))
        d: defer.Deferred[StageResult] = defer.Deferred()
        job = _StageJob([int(t) for t in tokens], start_layer, end_layer, hidden_in, d)
        with self._cond:
            self._stage_queue.append(job)
            self._cond.notify()
        return d

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(
            target=self._run, name="sfnode-transformers-engine", daemon=True
        )
        self._thread.start()

    def stop(self) -> defer.Deferred[None]:
        result: defer.Deferred[None] = defer.Deferred()
        if self._worker_gone:
            result.callback(None)
            return result
        self._stop_waiters.append(result)
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is None:
            self._abandon_all()
            self._post(self._worker_done)
        return result

    # -- thread crossing -----------------------------------------------------------------------

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def _post(self, f: Any, *args: Any) -> None:
        self._reactor.callFromThread(f, *args)

    def _worker_done(self) -> None:
        self._worker_gone = True
        waiters, self._stop_waiters = self._stop_waiters, []
        for d in waiters:
            d.callback(None)

    # -- the worker ------------------------------------------------------------------------------

    def _run(self) -> None:
        onednn_on_this_thread(self._onednn_layers > 0)
        try:
            with torch.inference_mode():
                while self._iteration():
                    pass
        except BaseException:
            log.failure("the transformers engine worker died")
        finally:
            self._abandon_all()
            self._post(self._worker_done)

    def _abandon_all(self) -> None:
        """Finish everything still queued or running as CANCELLED (the engine is stopping)."""
        with self._cond:
            jobs = list(self._incoming) + list(self._waiting)
            jobs += [lane.job for lane in self._prefilling + self._batch]
            stages = list(self._stage_queue)
            self._incoming.clear()
            self._stage_queue.clear()
            self._stopping = True
        self._waiting.clear()
        self._prefilling = []
        self._batch = []
        self._cache = None
        self._pad = []
        self._reserved_blocks = 0
        for job in jobs:
            self._ends.append((job.handle._finish, EngineStop.CANCELLED))
        self._publish()
        for stage in stages:
            self._post(stage.result.errback, StageForwardError("the engine is stopped"))

    def _busy(self) -> bool:
        return bool(self._waiting or self._prefilling or self._batch)

    def _iteration(self) -> bool:
        with self._cond:
            while (
                not self._stopping
                and not self._incoming
                and not self._stage_queue
                and not self._busy()
            ):
                self._cond.wait()
            if self._stopping:
                return False
            self._waiting.extend(self._incoming)
            self._incoming.clear()
            self._waiting_count = len(self._waiting)
            stage = self._stage_queue.popleft() if self._stage_queue else None
        if stage is not None:
            self._run_stage(stage)
        try:
            self._reap()
            if self._admit():
                self._publish()
            if self._prefilling and self._batch and self._prefilling[0].mixable:
                self._mixed_step()
            else:
                if self._prefilling:
                    self._prefill_some()
                    self._flush_tokens()
                if self._batch:
                    self._decode_step()
        except Exception as e:
            # A fault outside any one generation's forward (merging caches, say): the lanes that
            # were running fail, the queue and the engine carry on.
            for lane in self._prefilling + self._batch:
                self._fail_lane(lane, e)
                self._release(lane)
            self._prefilling = []
            self._batch = []
            self._cache = None
            self._pad = []
        self._publish()
        return True

    def _publish(self) -> None:
        """Update the statistics, then post the generations that ended (in that order, so a
        result never fires while the statistics still count its lane)."""
        self._flush_tokens()
        used = sum(_blocks(lane.tokens) for lane in self._prefilling + self._batch)
        with self._cond:
            self._kv_used = used
            self._lanes_active = len(self._prefilling) + len(self._batch)
            self._waiting_count = len(self._waiting)
        ends, self._ends = self._ends, []
        for f, arg in ends:
            self._post(f, arg)

    def _flush_tokens(self) -> None:
        """Hand this step's new tokens to the reactor in one call (one wake-up per step)."""
        if self._outbox:
            batch, self._outbox = self._outbox, []
            self._post(_dispatch_tokens, batch)

    def _finish_job(self, job: _Job, stop: EngineStop) -> None:
        self._ends.append((job.handle._finish, stop))

    def _release(self, lane: _Lane) -> None:
        self._reserved_blocks -= lane.job.reserve_blocks

    def _reap(self) -> None:
        """Drop cancelled and expired jobs and lanes (between steps)."""
        now = time.monotonic()

        def ended(job: _Job) -> EngineStop | None:
            if job.cancel_requested:
                return EngineStop.CANCELLED
            if job.deadline is not None and now >= job.deadline:
                return EngineStop.EXPIRED
            return None

        if any(ended(job) for job in self._waiting):
            kept: deque[_Job] = deque()
            for job in self._waiting:
                stop = ended(job)
                if stop is None:
                    kept.append(job)
                else:
                    self._finish_job(job, stop)
            self._waiting = kept
        for lane in list(self._prefilling):
            stop = ended(lane.job)
            if stop is not None:
                self._prefilling.remove(lane)
                self._release(lane)
                self._finish_job(lane.job, stop)
        leaving = []
        for lane in self._batch:
            stop = ended(lane.job)
            if stop is not None:
                leaving.append(lane)
                self._finish_job(lane.job, stop)
        if leaving:
            self._leave(leaving)

    def _admit(self) -> bool:
        """Move queued jobs into free lanes while their KV blocks fit (first come, first served).

        True when a job was admitted.
        """
        admitted = False
        while self._waiting and len(self._prefilling) + len(self._batch) < self._max_lanes:
            job = self._waiting[0]
            if self._reserved_blocks + job.reserve_blocks > self._kv_blocks_total:
                break
            self._waiting.popleft()
            self._reserved_blocks += job.reserve_blocks
            self._prefilling.append(
                _Lane(job=job, cache=lane_cache(self._config), mixable=self._mixable(job))
            )
            admitted = True
        return admitted

    def _fail_lane(self, lane: _Lane, error: BaseException) -> None:
        """Fail one generation; called inside the ``except`` block, so the traceback is logged."""
        log.failure("generation failed on the engine worker; the engine keeps serving")
        self._ends.append((lane.job.handle._fail, error))

    def _deliver(self, lane: _Lane, token: int) -> EngineStop | None:
        """Record and hand over one new token; the stop it causes, if any."""
        lane.generated.append(token)
        lane.next_input = token
        self._decoded += 1
        self._outbox.append((lane.job.handle, token))
        if token in lane.job.eos_ids:
            return EngineStop.EOS
        if len(lane.generated) >= lane.job.max_new or lane.tokens >= lane.job.token_limit:
            return EngineStop.LENGTH
        return None

    def _sample(self, logits: torch.Tensor, lanes: Sequence[_Lane]) -> list[int]:
        positions = [
            draw_position(lane.job.params.seed, len(lane.job.context), len(lane.generated))
            for lane in lanes
        ]
        return sample_tokens(logits, [lane.job.params for lane in lanes], positions)

    def _prefill_some(self) -> None:
        """Prefill up to about one chunk of tokens; lanes whose prompt is done join the batch."""
        budget = self._prefill_chunk
        for lane in list(self._prefilling):
            if budget <= 0:
                break
            context = lane.job.context
            try:
                while budget > 0 and lane.prefilled < len(context):
                    end = min(len(context), lane.prefilled + self._prefill_chunk)
                    logits = self._prefill_chunk_forward(lane, end)
                    budget -= end - lane.prefilled
                    self._prefilled += end - lane.prefilled
                    lane.prefilled = end
                if lane.prefilled < len(context):
                    break
            except Exception as e:
                self._prefilling.remove(lane)
                self._release(lane)
                self._fail_lane(lane, e)
                continue
            self._prefill_done(lane, logits)

    def _prefill_done(self, lane: _Lane, logits: torch.Tensor) -> None:
        """A lane's prompt is in its cache: its first token, then it joins the batch (or ends)."""
        self._prefilling.remove(lane)
        try:
            token = self._sample(logits, [lane])[0]
        except Exception as e:
            self._release(lane)
            self._fail_lane(lane, e)
            return
        stop = self._deliver(lane, token)
        if stop is not None:
            self._release(lane)
            self._finish_job(lane.job, stop)
            return
        try:
            self._join(lane)
        except Exception as e:
            # The batch cache may be half merged: this lane fails here, the iteration's handler
            # fails the batch.
            self._release(lane)
            self._fail_lane(lane, e)
            raise

    def _prefill_chunk_forward(self, lane: _Lane, end: int) -> torch.Tensor:
        start = lane.prefilled
        ids = torch.tensor([lane.job.context[start:end]], dtype=torch.long, device=self._device)
        positions = torch.arange(start, end, dtype=torch.long, device=self._device).unsqueeze(0)
        mask = torch.ones((1, end), dtype=torch.long, device=self._device)
        out = self._model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            cache=lane.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        logits: torch.Tensor = out.logits[:, -1, :].to(torch.float32)
        return logits

    def _join(self, lane: _Lane) -> None:
        """Merge a prefilled lane's cache into the batch cache (left padding to a common length)."""
        own = lane.cache
        lane.cache = None
        if self._cache is None or not self._batch:
            self._cache = own
            self._pad = [0]
            self._batch = [lane]
            return
        n = own.get_seq_length()
        length = self._cache.get_seq_length()
        new_length = max(n, length)
        rows = len(self._batch)
        for mine, theirs in zip(self._cache.layers, own.layers, strict=True):
            for attr in ("keys", "values"):
                old: torch.Tensor = getattr(mine, attr)
                add: torch.Tensor = getattr(theirs, attr)
                merged = old.new_zeros((rows + 1, old.shape[1], new_length, old.shape[3]))
                merged[:rows, :, new_length - length :, :] = old
                merged[rows, :, new_length - n :, :] = add[0]
                setattr(mine, attr, merged)
        self._pad = [p + new_length - length for p in self._pad] + [new_length - n]
        self._batch.append(lane)

    def _leave(self, leaving: Sequence[_Lane]) -> None:
        """Remove lanes from the batch cache and trim the padding every remaining row shares."""
        gone = {id(lane) for lane in leaving}
        keep = [i for i, lane in enumerate(self._batch) if id(lane) not in gone]
        for lane in leaving:
            self._release(lane)
        if not keep:
            self._batch = []
            self._cache = None
            self._pad = []
            return
        trim = min(self._pad[i] for i in keep)
        index = torch.tensor(keep, dtype=torch.long, device=self._device)
        for layer in self._cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, trim:, :]
            layer.values = layer.values.index_select(0, index)[:, :, trim:, :]
        self._batch = [self._batch[i] for i in keep]
        self._pad = [self._pad[i] - trim for i in keep]

    def _decode_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each decoding lane's next input token and position, and the batch's left padding."""
        lanes, device = self._batch, self._device
        ids = torch.tensor([[lane.next_input] for lane in lanes], dtype=torch.long, device=device)
        positions = torch.tensor([[lane.tokens - 1] for lane in lanes], device=device)
        pad = torch.tensor(self._pad, dtype=torch.long, device=device)
        return ids, positions, pad

    def _decode_step(self) -> None:
        """One forward pass over every decoding lane, then one token for each."""
        ids, positions, pad = self._decode_inputs()
        try:
            if self._llama_step is not None:
                logits = self._llama_step.logits(ids, positions, pad, self._cache)
            else:
                logits = self._model_step(ids, positions, pad)
        except Exception as e:
            self._fail_batch(e)
            return
        self._advance_batch(logits)

    def _mixable(self, job: _Job) -> bool:
        """Whether the job's prompt chunks can ride along with decode steps.

        Only with the lean Llama step, and only for ids inside the vocabulary: a prompt that
        cannot run must fail its own generation, not the lanes it would have shared a pass with.
        """
        context = job.context
        return (
            self._llama_step is not None and 0 <= min(context) and max(context) < self._vocab_size
        )

    def _mixed_step(self) -> None:
        """One decode step and the first prefilling lane's next chunk, in one forward pass."""
        assert self._llama_step is not None
        lane = self._prefilling[0]
        context = lane.job.context
        end = min(len(context), lane.prefilled + self._prefill_chunk)
        chunk = torch.tensor([context[lane.prefilled : end]], dtype=torch.long, device=self._device)
        ids, positions, pad = self._decode_inputs()
        try:
            logits, chunk_logits = self._llama_step.logits_with_chunk(
                ids, positions, pad, self._cache, chunk, lane.cache
            )
        except Exception as e:
            # Both caches may be half written: the prefilling lane fails with the batch.
            self._prefilling.remove(lane)
            self._release(lane)
            self._fail_lane(lane, e)
            self._fail_batch(e)
            return
        self._prefilled += end - lane.prefilled
        lane.prefilled = end
        self._advance_batch(logits)
        if lane.prefilled == len(context):
            self._prefill_done(lane, chunk_logits)

    def _advance_batch(self, logits: torch.Tensor) -> None:
        """Sample and hand over one token per decoding lane; lanes that stop leave the batch."""
        lanes = self._batch
        try:
            tokens = self._sample(logits.to(torch.float32), lanes)
        except Exception as e:
            self._fail_batch(e)
            return
        leaving = []
        for lane, token in zip(lanes, tokens, strict=True):
            stop = self._deliver(lane, token)
            if stop is not None:
                leaving.append(lane)
                self._finish_job(lane.job, stop)
        if leaving:
            self._leave(leaving)

    def _fail_batch(self, error: BaseException) -> None:
        """Fail every decoding lane (called inside an ``except`` block) and empty the batch."""
        lanes = list(self._batch)
        for lane in lanes:
            self._fail_lane(lane, error)
        self._leave(lanes)

    def _model_step(
        self, ids: torch.Tensor, positions: torch.Tensor, pad: torch.Tensor
    ) -> torch.Tensor:
        """One decode step through the model's own forward (any causal LM)."""
        length = self._cache.get_seq_length() + 1
        columns = torch.arange(length, device=self._device).unsqueeze(0)
        out = self._model(
            input_ids=ids,
            attention_mask=(columns >= pad.unsqueeze(1)).to(torch.long),
            position_ids=positions,
            cache=self._cache,
            use_cache=True,
            logits_to_keep=1,
        )
        logits: torch.Tensor = out.logits[:, -1, :]
        return logits

    # -- stage forward (worker) --------------------------------------------------------------

    def _run_stage(self, stage: _StageJob) -> None:
        try:
            result = self.stage_forward_now(stage.tokens, stage.start, stage.end, stage.hidden_in)
        except StageForwardError as e:
            self._post(stage.result.errback, e)
            return
        except Exception as e:
            log.failure("stage forward failed")
            self._post(stage.result.errback, StageForwardError(f"stage forward failed: {e}"))
            return
        self._post(stage.result.callback, result)

    def stage_forward_now(
        self, tokens: Sequence[int], start: int, end: int, hidden_in: bytes | None
    ) -> StageResult:
        """Run layers ``[start, end)`` synchronously (worker thread or tests without a worker)."""
        inner = getattr(self._model, "model", None)
        layers = getattr(inner, "layers", None)
        if inner is None or layers is None or not hasattr(inner, "rotary_emb"):
            raise StageForwardError("stage forward needs a Llama-family model")
        if not 0 <= start <= end <= self._n_layers:
            raise StageForwardError(
                f"bad layer bounds [{start}, {end}) for {self._n_layers} layers"
            )
        from transformers.masking_utils import create_causal_mask

        dtype = next(self._model.parameters()).dtype
        with torch.inference_mode():
            if hidden_in is None:
                if start != 0 or not tokens:
                    raise StageForwardError("a first stage needs tokens and start_layer 0")
                ids = torch.tensor([list(tokens)], dtype=torch.long, device=self._device)
                if int(ids.min()) < 0 or int(ids.max()) >= int(self._config.vocab_size):
                    raise StageForwardError("a token id is outside the vocabulary")
                hidden = inner.embed_tokens(ids)
            else:
                h = decode_hidden(hidden_in, int(self._config.hidden_size))
                hidden = h.to(device=self._device, dtype=dtype).unsqueeze(0)
            n = hidden.shape[1]
            positions = torch.arange(n, dtype=torch.long, device=self._device).unsqueeze(0)
            mask = create_causal_mask(
                config=self._config,
                inputs_embeds=hidden,
                attention_mask=None,
                cache=None,
                position_ids=positions,
            )
            rotary = inner.rotary_emb(hidden, position_ids=positions)
            for layer in layers[start:end]:
                hidden = layer(
                    hidden,
                    attention_mask=mask,
                    position_embeddings=rotary,
                    position_ids=positions,
                    cache=None,
                    use_cache=False,
                )
            if end < self._n_layers:
                return StageResult(hidden=encode_hidden(hidden[0]))
            last = inner.norm(hidden[:, -1:, :])
            logits = self._model.lm_head(last)[0, -1, :].to(torch.float32)
            return StageResult(token=int(torch.argmax(logits).item()))


if TYPE_CHECKING:

    def _conforms(engine: TransformersEngine, generation: _Generation) -> tuple[Engine, Generation]:
        """mypy checks here that the engine and its handle implement the node's protocols."""
        return engine, generation
