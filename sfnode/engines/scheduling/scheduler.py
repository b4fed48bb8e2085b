"""The engine's scheduler: who decodes, whose prompt is computed, who waits, in each step.

It is pure: it takes requests, cancellations and the clock's readings, and answers each
:meth:`Scheduler.plan` with a :class:`~sfnode.engines.scheduling.plan.StepPlan` for a model runner;
the runner's :class:`~sfnode.engines.scheduling.plan.StepOutput` comes back through
:meth:`Scheduler.complete`, which answers with the tokens each generation got and the generations
that ended.  The rules (docs/engine.md section 3):

- **Lanes.**  Up to ``lanes`` generations run at once, each in a KV slot of its own.  A waiting
  request is admitted into the lowest free slot between steps, first come first served, when the
  KV blocks it may need (``ceil(min(context + max_new, window) / 16)``) fit in the pool;
  otherwise it and everything behind it waits.
- **Prefill.**  An admitted lane's prompt is computed in chunks of at most ``prefill_chunk``
  tokens, ending on multiples of ``prefill_chunk`` from the start of the context.  Each step
  carries every decoding lane's next token and then prompt chunks of several lanes, oldest
  first, up to ``step_tokens`` prompt tokens (at least one chunk, so every prompt progresses).
  A prompt whose last chunk is computed yields its first token in that same step.
- **Steps sized in time.**  While interactive work waits, runs, or could be admitted at once
  (a lane is free), batch prompt chunks are instead cut so that the step's predicted time,
  from the :class:`~sfnode.engines.scheduling.pace.StepRates` the engine measured, stays within
  ``step_ms``: such a chunk is at most ``prefill_chunk`` tokens from where its prompt stands and
  ends on a block boundary (or the prompt's end), and a step always carries at least one block
  of one prompt.  So a chat arriving beside batch work waits for a step of about ``step_ms``, on a
  slow CPU as on a fast one.  Otherwise (or with ``step_ms`` 0) only ``step_tokens`` bounds a
  step.
- **Interactive first.**  An interactive request (a person waiting) is admitted before any
  batch request, and ``interactive_lanes`` lanes are kept for such requests: batch work holds
  at most ``lanes - interactive_lanes`` lanes (at least one), so a chat never waits for a batch
  lane to finish.  A step that computes an interactive prompt carries no batch prompt chunks
  (the decode rows still go), so its first token is one short step away.
- **Prefix reuse.**  With a :class:`~sfnode.engines.scheduling.prefix_cache.PrefixCache`, an
admitted lane
  first gets the cached blocks its context starts with, and the positions it shares with a
  cached block that goes on differently (copied into its slot), and computes only the rest;
  full blocks a lane computed are saved into the cache in the next step.  A request whose next
  uncached block is being computed by another lane's prompt right now waits for it instead of
  computing it twice (requests behind it may go first).
- **Drafts.**  With a :class:`~sfnode.engines.scheduling.drafts.Speculation`, a decoding lane's row
carries
  the tokens that followed the last earlier occurrence of the n-gram its tokens end with
  (prompt lookup, docs/engine.md section 3.1), as many as its
  :class:`~sfnode.engines.scheduling.drafts.DraftLength` allows and never more than its ``max_new``
  and token limit leave room for, and ending before any EOS id; the runner answers the tokens the
  sampler drew at the positions the accepted ones opened, and they are emitted in order like
  any other.
- **Ends.**  A lane ends on an EOS id (the id is its last token), at ``max_new`` tokens or its
  token limit, when cancelled, when its wall deadline passes (checked between steps), or when the
  step it was in failed.

This module must never import torch, call a runner or a reactor, or read a clock of its own.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from sfnode.decoding.constraint import LaneStage
from sfnode.decoding.draws import draw_position
from sfnode.engines.scheduling.drafts import DraftLength, PromptLookup, Speculation
from sfnode.engines.scheduling.pace import StepCost, StepRates
from sfnode.engines.scheduling.plan import BlockCopy, ChunkRow, DecodeRow, StepOutput, StepPlan
from sfnode.engines.scheduling.prefix_cache import PrefixCache
from sfnode.generation import EngineStop, StepFigures, TokenLogprob
from sfnode.linkf.prefix_blocks import KV_BLOCK_TOKENS, BlockKey, block_keys
from sfnode.linkf.wire import GenParams


def blocks_for(tokens: int) -> int:
    """KV blocks that hold ``tokens`` tokens."""
    return -(-tokens // KV_BLOCK_TOKENS)


@dataclass(eq=False)
class Request:
    """A generation as the scheduler sees it; ``handle`` is the engine's, opaque here."""

    handle: Any
    context: tuple[int, ...]
    params: GenParams
    max_new: int
    token_limit: int
    """The most tokens (context + new) the lane may hold."""
    reserve_blocks: int
    eos_ids: frozenset[int]
    deadline: float | None = None
    interactive: bool = False
    cancelled: bool = False
    stage: LaneStage | None = None
    """The lane's constraint and sampler controls (docs/engine.md section 2.4); its rows carry
    it to the runner, and it ends with the lane."""


@dataclass(eq=False)
class Lane:
    """An admitted request: its slot, how much of it is in the slot's KV, its new tokens."""

    request: Request
    slot: int
    computed: int = 0
    """Tokens of context + generated whose KV the slot holds."""
    generated: list[int] = field(default_factory=list)
    keys: list[BlockKey] = field(default_factory=list)
    """Chain keys of the lane's full blocks, as far as they were needed."""
    saved: int = 0
    """Leading full blocks that are in the prefix cache (copied there or from there)."""
    pending: list[BlockKey] = field(default_factory=list)
    """Keys of prompt blocks this lane will compute that others may wait for."""
    lookup: PromptLookup | None = None
    """The n-gram index its drafts come from (built when it first decodes with speculation)."""
    draft_length: DraftLength | None = None

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.request.context)

    @property
    def tokens(self) -> int:
        return len(self.request.context) + len(self.generated)


class Emitted(NamedTuple):
    """A new token of a generation (with its logprobs when the request asked for them)."""

    request: Request
    token: int
    logprob: TokenLogprob | None = None


class Ended(NamedTuple):
    """A generation that ended: with ``stop``, or failed with ``error``; ``closed`` when it
    ended with its grammar's end while its budget held it to the closing (docs/engine.md
    section 2.4)."""

    request: Request
    stop: EngineStop | None
    error: BaseException | None = None
    closed: bool = False


@dataclass
class SchedulerCounts:
    """Cumulative figures since start: tokens decoded and prompt tokens computed, and the
    figures of :class:`~sfnode.generation.StepFigures` (which :meth:`figures` reports)."""

    decoded: int = 0
    prefilled: int = 0
    steps: int = 0
    decode_rows: int = 0
    decode_tokens: int = 0
    drafted: int = 0
    accepted: int = 0

    def figures(self, speculative: bool) -> StepFigures:
        """The step figures now, as a value."""
        return StepFigures(
            self.steps,
            self.decode_rows,
            self.decode_tokens,
            speculative,
            self.drafted,
            self.accepted,
        )


class Scheduler:
    """Plans steps over ``lanes`` KV slots and a pool of ``kv_blocks`` blocks."""

    def __init__(
        self,
        *,
        lanes: int,
        kv_blocks: int,
        prefill_chunk: int = 256,
        step_tokens: int = 512,
        prefix: PrefixCache | None = None,
        salt: bytes = b"",
        interactive_lanes: int = 1,
        speculation: Speculation | None = None,
        step_ms: float = 0.0,
    ) -> None:
        if lanes < 1:
            raise ValueError("lanes must be at least 1")
        if prefill_chunk < 1 or step_tokens < 1:
            raise ValueError("prefill_chunk and step_tokens must be at least 1")
        if step_ms < 0:
            raise ValueError("step_ms must not be negative")
        self.lanes = lanes
        self.kv_blocks = kv_blocks
        self.prefill_chunk = prefill_chunk
        self.step_tokens = step_tokens
        self.step_ms = step_ms
        """The time budget of a step while interactive work may need it (0: none)."""
        self.prefix = prefix
        self.speculation = speculation
        self._salt = salt
        self.batch_lanes = max(1, lanes - max(0, interactive_lanes))
        """The most lanes batch requests hold at once."""
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Lane] = {}
        self._order: list[Lane] = []
        """Running lanes in admission order (prefill goes oldest first)."""
        self._reserved = 0
        self._retired: list[Lane] = []
        """Lanes that ended after the last plan; their blocks are saved in the next one."""
        self._pending: dict[BlockKey, Lane] = {}
        self._saving: list[BlockKey] = []
        """Keys whose blocks the last plan writes (forgotten again if that step fails)."""
        self.counts = SchedulerCounts()

    # -- state ----------------------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        """Nothing waits, runs, or has blocks left to save."""
        return not (self.waiting or self.running or self._retired)

    @property
    def kv_blocks_used(self) -> int:
        return sum(blocks_for(lane.tokens) for lane in self.running.values())

    def submit(self, request: Request) -> None:
        self.waiting.append(request)

    def cancel(self, request: Request) -> None:
        """Mark ``request`` cancelled; it ends at the next plan."""
        request.cancelled = True

    def abandon(self) -> list[Ended]:
        """End everything as CANCELLED (the engine is stopping); the scheduler is then empty."""
        ended = [Ended(r, EngineStop.CANCELLED) for r in self.waiting]
        ended += [Ended(lane.request, EngineStop.CANCELLED) for lane in self._order]
        self.waiting.clear()
        for lane in list(self._order):
            self._free(lane)
        self._retired.clear()
        return ended

    # -- planning -------------------------------------------------------------------------------

    def plan(self, now: float, rates: StepRates | None = None) -> tuple[StepPlan, list[Ended]]:
        """The next step (maybe empty) and the generations that ended before it; ``rates``
        are what steps take here (without them, steps are sized in tokens only)."""
        ended = self._reap(now)
        saves = self._saves()
        loads = self._admit()
        decode = tuple(
            DecodeRow(
                slot=lane.slot,
                token=lane.generated[-1],
                position=lane.tokens - 1,
                params=lane.request.params,
                draw=draw_position(
                    lane.request.params.seed, len(lane.request.context), len(lane.generated)
                ),
                stage=lane.request.stage,
                draft=self._draft(lane),
            )
            for lane in sorted(self._order, key=lambda lane: lane.slot)
            if not lane.prefilling
        )
        chunks = self._chunks(decode, rates)
        plan = StepPlan(decode=decode, chunks=tuple(chunks), loads=tuple(loads), saves=saves)
        if plan.decode or plan.chunks:
            self.counts.steps += 1
        return plan, ended

    def interactive_expected(self) -> bool:
        """Whether interactive work waits, runs, or would be admitted at once if it came (a
        lane is free): then a step's prompt chunks are sized in time (see the rules)."""
        return (
            len(self.running) < self.lanes
            or any(request.interactive for request in self.waiting)
            or any(lane.request.interactive for lane in self._order)
        )

    def _chunks(self, decode: tuple[DecodeRow, ...], rates: StepRates | None) -> list[ChunkRow]:
        """The prompt chunks of the next step, beside ``decode`` (see the rules)."""
        chunks: list[ChunkRow] = []
        tokens_left = self.step_tokens
        prefilling = [lane for lane in self._order if lane.prefilling]
        interactive = [lane for lane in prefilling if lane.request.interactive]
        seconds_left: float | None = None
        if not interactive and rates is not None and self.step_ms > 0:
            if self.interactive_expected():
                spent = rates.seconds(StepCost(decode_rows=len(decode)))
                seconds_left = self.step_ms / 1000.0 - spent
        for lane in interactive or prefilling:
            context = lane.request.context
            start = lane.computed
            if seconds_left is not None and rates is not None:
                end = min(len(context), start + self.prefill_chunk)
                end = self._fitting_end(start, end, seconds_left, rates)
                if end <= start:
                    if chunks:
                        break
                    # Every step moves a prompt on by at least a block.
                    end = min(len(context), (start // KV_BLOCK_TOKENS + 1) * KV_BLOCK_TOKENS)
                seconds_left -= rates.prompt_seconds(start, end)
            else:
                end = min(len(context), (start // self.prefill_chunk + 1) * self.prefill_chunk)
            size = end - start
            if chunks and size > tokens_left:
                break
            tokens_left -= size
            chunks.append(
                ChunkRow(
                    slot=lane.slot,
                    start=start,
                    tokens=context[start:end],
                    last=end == len(context),
                    params=lane.request.params,
                    draw=draw_position(lane.request.params.seed, len(context), 0),
                    stage=lane.request.stage if end == len(context) else None,
                )
            )
            if tokens_left <= 0 or (seconds_left is not None and seconds_left <= 0):
                break
        return chunks

    @staticmethod
    def _fitting_end(start: int, end: int, seconds: float, rates: StepRates) -> int:
        """The furthest end up to ``end``, on a block boundary unless it is ``end`` itself, whose
        rows from ``start`` are predicted to take at most ``seconds`` (``start`` when none)."""
        if rates.prompt_seconds(start, end) <= seconds:
            return end
        low = start // KV_BLOCK_TOKENS + 1
        high = (end - 1) // KV_BLOCK_TOKENS
        best = start
        while low <= high:
            middle = (low + high) // 2
            candidate = middle * KV_BLOCK_TOKENS
            if rates.prompt_seconds(start, candidate) <= seconds:
                best, low = candidate, middle + 1
            else:
                high = middle - 1
        return best

    def _draft(self, lane: Lane) -> tuple[int, ...]:
        """The tokens guessed to follow the lane's next one (none without speculation)."""
        speculation = self.speculation
        if speculation is None:
            return ()
        request = lane.request
        # Room for the draft and the token after it, within max_new and the token limit.
        room = min(request.max_new - len(lane.generated), request.token_limit - lane.tokens) - 1
        if room < 1:
            return ()
        if lane.lookup is None:
            lane.lookup = PromptLookup(
                request.context + tuple(lane.generated),
                ngram_min=speculation.ngram_min,
                ngram_max=speculation.ngram_max,
            )
            lane.draft_length = DraftLength(speculation.draft_tokens)
        assert lane.draft_length is not None
        limit = min(room, lane.draft_length.budget())
        draft = lane.lookup.draft(limit) if limit > 0 else ()
        # A draft stops before an EOS id: no row is ever sampled after a lane's end.
        for index, token in enumerate(draft):
            if token in request.eos_ids:
                return draft[:index]
        return draft

    def _reap(self, now: float) -> list[Ended]:
        ended: list[Ended] = []

        def stop_of(request: Request) -> EngineStop | None:
            if request.cancelled:
                return EngineStop.CANCELLED
            if request.deadline is not None and now >= request.deadline:
                return EngineStop.EXPIRED
            return None

        kept: deque[Request] = deque()
        for request in self.waiting:
            stop = stop_of(request)
            if stop is None:
                kept.append(request)
            else:
                ended.append(Ended(request, stop))
        self.waiting = kept
        for lane in list(self._order):
            stop = stop_of(lane.request)
            if stop is not None:
                ended.append(Ended(lane.request, stop))
                self._retire(lane)
        return ended

    def _admit(self) -> list[BlockCopy]:
        """Admit waiting requests, interactive ones first, into free lanes (see the rules)."""
        loads: list[BlockCopy] = []
        order = [r for r in self.waiting if r.interactive] + [
            r for r in self.waiting if not r.interactive
        ]
        admitted: set[int] = set()
        for request in order:
            if len(self.running) >= self.lanes:
                break
            if not request.interactive:
                batch = sum(not lane.request.interactive for lane in self._order)
                if batch >= self.batch_lanes:
                    break
            if self._reserved + request.reserve_blocks > self.kv_blocks:
                break
            load = self._admit_one(request)
            if load is None:
                continue  # its prefix is being computed by another lane: it waits for it
            admitted.add(id(request))
            if load.blocks:
                loads.append(load)
        self.waiting = deque(r for r in self.waiting if id(r) not in admitted)
        return loads

    def _admit_one(self, request: Request) -> BlockCopy | None:
        """Give ``request`` a lane and its cached prefix; None when it must wait for blocks
        another lane is computing."""
        keys: list[BlockKey] = []
        reused: list[int] = []
        tail = KV_BLOCK_TOKENS
        context = request.context
        if self.prefix is not None:
            # At least one prompt token is computed: its logits give the first token.
            usable = len(context) - 1
            keys = block_keys(context, self._salt, usable // KV_BLOCK_TOKENS)
            reused = self.prefix.match(keys)
            full = len(reused)
            if full < len(keys) and keys[full] in self._pending:
                return None
            # Then the positions it shares with a cached block that goes on differently.
            parent = keys[full - 1] if full else self._salt
            start = full * KV_BLOCK_TOKENS
            block, shared = self.prefix.partial(parent, context[start : min(usable, start + 16)])
            if shared:
                reused.append(block)
                tail = shared
            self.prefix.record_use(full * KV_BLOCK_TOKENS + shared)
        slot = min(set(range(self.lanes)) - set(self.running))
        full = len(reused) - (tail < KV_BLOCK_TOKENS)
        lane = Lane(
            request=request,
            slot=slot,
            computed=full * KV_BLOCK_TOKENS + (tail if tail < KV_BLOCK_TOKENS else 0),
        )
        lane.keys = keys
        lane.saved = full
        lane.pending = [k for k in keys[full:] if k not in self._pending]
        for key in lane.pending:
            self._pending[key] = lane
        self.running[slot] = lane
        self._order.append(lane)
        self._reserved += request.reserve_blocks
        return BlockCopy(slot=slot, first=0, blocks=tuple(reused), tail=tail)

    def _saves(self) -> tuple[BlockCopy, ...]:
        self._saving = []
        if self.prefix is None:
            self._retired.clear()
            return ()
        saves: list[BlockCopy] = []
        for lane in self._retired + self._order:
            saves.extend(self._save_lane(lane))
        self._retired.clear()
        return tuple(saves)

    def _save_lane(self, lane: Lane) -> Iterable[BlockCopy]:
        assert self.prefix is not None
        full = lane.computed // KV_BLOCK_TOKENS
        if full <= lane.saved:
            return ()
        tokens = lane.request.context + tuple(lane.generated)
        if len(lane.keys) < full:
            lane.keys = block_keys(tokens[: full * KV_BLOCK_TOKENS], self._salt, known=lane.keys)
        runs: list[BlockCopy] = []
        first, blocks = lane.saved, list[int]()
        for index in range(lane.saved, full):
            key = lane.keys[index]
            if self._pending.get(key) is lane:
                del self._pending[key]
            parent = lane.keys[index - 1] if index else self._salt
            span = tokens[index * KV_BLOCK_TOKENS : (index + 1) * KV_BLOCK_TOKENS]
            block = self.prefix.allocate(key, parent, span)
            if block is None:
                if blocks:
                    runs.append(BlockCopy(lane.slot, first, tuple(blocks)))
                first, blocks = index + 1, []
                continue
            blocks.append(block)
            self._saving.append(key)
        if blocks:
            runs.append(BlockCopy(lane.slot, first, tuple(blocks)))
        lane.saved = full
        return runs

    # -- results ----------------------------------------------------------------------------------

    def complete(self, plan: StepPlan, output: StepOutput) -> tuple[list[Emitted], list[Ended]]:
        """Apply a step's output: the new tokens, and the generations they ended."""
        emitted: list[Emitted] = []
        ended: list[Ended] = []
        decode_logprobs = output.decode_logprobs or (None,) * len(plan.decode)
        chunk_logprobs = output.chunk_logprobs or (None,) * len(plan.chunks)
        drafted = output.drafted or ((),) * len(plan.decode)
        drafted_logprobs = output.drafted_logprobs or ((),) * len(plan.decode)
        for row, token, logprob, more, more_logprobs in zip(
            plan.decode, output.decode, decode_logprobs, drafted, drafted_logprobs, strict=True
        ):
            if len(more) > len(row.draft):
                raise ValueError("the runner accepted more tokens than the row drafted")
            lane = self.running[row.slot]
            self.counts.decode_rows += 1
            self.counts.drafted += len(row.draft)
            if lane.draft_length is not None:
                lane.draft_length.verified(len(row.draft), len(more))
            logprobs = more_logprobs or (None,) * len(more)
            for index, (new, new_logprob) in enumerate(
                zip((token, *more), (logprob, *logprobs), strict=True)
            ):
                # Each token's row fed the one before it: its KV is now in the slot.
                lane.computed += 1
                self.counts.decode_tokens += 1
                self.counts.accepted += 1 if index else 0
                if self._emit(lane, new, new_logprob, emitted, ended):
                    break
        for chunk, first, logprob in zip(plan.chunks, output.chunks, chunk_logprobs, strict=True):
            lane = self.running[chunk.slot]
            lane.computed = chunk.start + len(chunk.tokens)
            self.counts.prefilled += len(chunk.tokens)
            if chunk.last:
                if first is None:
                    raise ValueError("the runner gave no first token for a prompt's last chunk")
                self._emit(lane, first, logprob, emitted, ended)
        return emitted, ended

    def _emit(
        self,
        lane: Lane,
        token: int,
        logprob: TokenLogprob | None,
        emitted: list[Emitted],
        ended: list[Ended],
    ) -> bool:
        """Give the lane its next token; True when that ended it."""
        request = lane.request
        lane.generated.append(token)
        if lane.lookup is not None:
            lane.lookup.extend((token,))
        self.counts.decoded += 1
        emitted.append(Emitted(request, token, logprob))
        stop = None
        if token in request.eos_ids:
            stop = EngineStop.EOS
        elif len(lane.generated) >= request.max_new or lane.tokens >= request.token_limit:
            stop = EngineStop.LENGTH
        if stop is None:
            return False
        closed = stop is EngineStop.EOS and request.stage is not None and request.stage.closed
        ended.append(Ended(request, stop, closed=closed))
        self._retire(lane)
        return True

    def fail(self, plan: StepPlan, error: BaseException) -> list[Ended]:
        """A step failed: every lane it computed for fails; blocks it was saving are forgotten."""
        if self.prefix is not None:
            for key in self._saving:
                self.prefix.discard(key)
        self._saving = []
        ended: list[Ended] = []
        slots = {row.slot for row in plan.decode} | {chunk.slot for chunk in plan.chunks}
        slots |= {load.slot for load in plan.loads}
        for slot in sorted(slots):
            lane = self.running.get(slot)
            if lane is not None:
                ended.append(Ended(lane.request, None, error))
                self._free(lane)
        return ended

    def _retire(self, lane: Lane) -> None:
        """The lane ended normally: free its slot now, save its blocks in the next plan."""
        self._free(lane)
        if self.prefix is not None:
            self._retired.append(lane)

    def _free(self, lane: Lane) -> None:
        if self.running.get(lane.slot) is lane:
            del self.running[lane.slot]
            self._order.remove(lane)
            self._reserved -= lane.request.reserve_blocks
        for key in lane.pending:
            if self._pending.get(key) is lane:
                del self._pending[key]
        lane.pending = []
