"""The node's running generations (docs/protocol.md section 7.3): each one the owner of its
generation machine and of its engine generation, and the table of all of them.

A :class:`NodeGeneration` turns what its engine hands over into the machine's inputs (the
tokens, checked when the generation asked for logprobs; the result; a refusal or a failure),
and what the machine decides into token events through its session's retry buffer, on the
connection its session was last reconciled to.  While that connection's head does not read, it
holds its batches (``max_held_tokens`` at most, then it stops as if the head were gone); when
the retry buffer reaches ``max_unacked_events`` it stops and fences its session.

:class:`GenerationTable` holds every generation of the node by key, starts them, cancels those of
a session, and is what the drain machine asks about them
(:class:`~sfnode.node.machines.DrainOwner`).

This module never decodes or frames bytes itself (a :class:`~sfnode.node.protocol.NodeConnection`
sends) and reads time only from the clock it is given.  Section numbers are those of
docs/protocol.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from twisted.logger import Logger
from twisted.python.failure import Failure

from sfnode.generation import (
    EngineRefusal,
    Generation,
    GenerationRequest,
    GenerationResult,
    TokenBatch,
    TokenLogprob,
)
from sfnode.linkf.idempotency import GenerationKey
from sfnode.linkf.wire import F32_MAX, Finish, Tokens, TokensLogprobs
from sfnode.node.config import COALESCE_MS, COALESCE_TOKENS, NodeCommon
from sfnode.node.heads import HeadSessions, HeadTables
from sfnode.node.machines import GenerationCore, GenerationInputs, GenerationMachine

if TYPE_CHECKING:
    from sfnode.node.protocol import NodeConnection

log = Logger()


def checked_logprobs(batch: TokenBatch, asked: int) -> TokenBatch:
    """An engine's batch as a TokensLogprobs event may carry it (section 12.1): ``asked - 1``
    alternatives at most (none when ``asked`` is 1), every value clamped into
    ``[-f32 max, 0]`` (rounding above 0, and -inf for a token the engine gave no chance).

    :raises ValueError: no logprobs, or a NaN (an engine fault).
    """
    if batch.logprobs is None:
        raise ValueError("the engine handed over tokens without their logprobs")
    alternatives = asked - 1
    return TokenBatch(
        batch.tokens,
        tuple(
            TokenLogprob(
                _clamped(entry.logprob),
                tuple((token, _clamped(value)) for token, value in entry.top[:alternatives]),
            )
            for entry in batch.logprobs
        ),
    )


def _clamped(value: float) -> float:
    if math.isnan(value):
        raise ValueError("the engine gave a NaN logprob")
    return min(max(value, -F32_MAX), 0.0)


@dataclass(eq=False)
class NodeGeneration:
    """One accepted generation: the owner of its machine and of its engine generation."""

    table: GenerationTable
    key: GenerationKey
    connection: NodeConnection
    """Where its events go; moved by a RECONCILE, kept when closed (events then wait)."""
    head: HeadSessions
    """The table of the head whose session it is."""
    logprobs: int = 0
    """The session's GenParams.logprobs as this node honours it: 0 sends Tokens events; n from
    1 to LOGPROBS_MAX sends TokensLogprobs with n - 1 alternatives (section 12.1)."""
    machine: GenerationInputs = field(init=False)
    engine_generation: Generation | None = None
    held: list[TokenBatch] = field(default_factory=list)
    """Batches not emitted yet because the head stopped reading (bounded by max_held_tokens)."""
    held_tokens: int = 0

    # -- what the engine hands over ----------------------------------------------------------

    def on_tokens(self, batch: TokenBatch) -> None:
        """The engine's ``on_tokens``: the batch, checked when the generation asked for
        logprobs (an engine fault fails the generation)."""
        if not self.logprobs:
            self.machine.tokens(batch if batch.logprobs is None else TokenBatch(batch.tokens))
            return
        try:
            checked = checked_logprobs(batch, self.logprobs)
        except ValueError as e:
            log.error(
                "generation {generation} of session {session}: {error}",
                generation=self.key.generation_id,
                session=self.key.session_id,
                error=str(e),
            )
            self.stop_engine()
            self.machine.failed(str(e))
            return
        self.machine.tokens(checked)

    def engine_failed(self, failure: Failure) -> None:
        """A refusal (FINISH_REFUSED) or an engine failure (the connection closes, 7.4)."""
        if isinstance(failure.value, EngineRefusal):
            log.info(
                "refused generation {generation} of session {session}: {reason}",
                generation=self.key.generation_id,
                session=self.key.session_id,
                reason=failure.getErrorMessage(),
            )
            self.machine.refused()
        else:
            log.failure("generation {key} failed in the engine", failure, key=tuple(self.key))
            self.machine.failed(failure.getErrorMessage())

    def engine_finished(self, result: GenerationResult) -> None:
        self.machine.finished(result)

    # -- GenerationOwner ---------------------------------------------------------------------

    def emit_tokens(self, batch: TokenBatch) -> bool:
        connection = self.connection
        if connection.open and not connection.writable:
            self.held.append(batch)
            self.held_tokens += len(batch)
            cap = self.table.config.max_held_tokens
            if cap and self.held_tokens > cap:
                log.warn(
                    "stopped generation {generation} of session {session}: its head at {peer} "
                    "has not read for {count} tokens (max_held_tokens {cap})",
                    generation=self.key.generation_id,
                    session=self.key.session_id,
                    peer=connection.peer,
                    count=self.held_tokens,
                    cap=cap,
                )
                self._take_held()
                return False
            return True
        return self._emit(self._payload(TokenBatch.join([*self._take_held(), batch])))

    def release_held(self) -> None:
        """The head reads again: send what was held (a refusal stops it at the next flush)."""
        if self.held:
            self._emit(self._payload(TokenBatch.join(self._take_held())))

    def _take_held(self) -> list[TokenBatch]:
        held, self.held = self.held, []
        self.held_tokens = 0
        return held

    def _payload(self, batch: TokenBatch) -> Tokens:
        """Tokens, or TokensLogprobs for a generation that asked for logprobs (coalesced
        together, so an event carries the logprobs of exactly its tokens)."""
        if not self.logprobs:
            return Tokens(batch.tokens)
        logprobs = batch.logprobs or ()
        return TokensLogprobs(
            batch.tokens,
            tuple(entry.logprob for entry in logprobs),
            tuple(entry.top for entry in logprobs) if self.logprobs > 1 else (),
        )

    def emit_finish(self, reason: int, detail: int = 0) -> None:
        self.release_held()
        self._emit(Finish(reason, detail))

    def _emit(self, payload: Tokens | Finish) -> bool:
        sessions = self.head.table
        session_id, generation_id, _ = self.key
        cap = self.table.config.max_unacked_events
        if cap and sessions.unacked_events(session_id, generation_id) >= cap:
            sessions.give_up(
                session_id,
                f"generation {generation_id} has {cap} unacknowledged events "
                f"(max_unacked_events {cap})",
            )
            return False
        batch = sessions.emit(session_id, generation_id, payload)
        if batch is None:
            return False
        self.connection.send(batch)
        return True

    def stop_engine(self) -> None:
        if self.engine_generation is not None:
            self.engine_generation.cancel()

    def fail(self, reason: str) -> None:
        self.connection.close(
            f"generation {self.key.generation_id} of session {self.key.session_id} failed in "
            f"the engine: {reason}"
        )

    def done(self) -> None:
        self.table.done(self)


class GenerationTable:
    """Every generation of one node, running or queued, by key (see the module)."""

    def __init__(
        self,
        common: NodeCommon,
        heads: HeadTables,
        on_start: Callable[[], None],
        on_end: Callable[[], None],
    ) -> None:
        """``on_start`` and ``on_end`` are told when a generation starts and ends."""
        self._common = common
        self.config = common.config
        self._heads = heads
        self._on_start = on_start
        self._on_end = on_end
        self._generations: dict[GenerationKey, NodeGeneration] = {}

    def __len__(self) -> int:
        return len(self._generations)

    def get(self, key: GenerationKey) -> NodeGeneration | None:
        return self._generations.get(key)

    def start(
        self,
        connection: NodeConnection,
        head: HeadSessions,
        key: GenerationKey,
        request: GenerationRequest,
    ) -> None:
        """Run ``request`` on the engine as generation ``key`` of ``head``'s session."""
        previous = self._generations.get(key)
        if previous is not None:
            # The same generation id again with a fresh command: the entry (and its event
            # sequence) continues (section 6.2); the older run stops sending.
            previous.machine.cancel()
        generation = NodeGeneration(self, key, connection, head, logprobs=request.params.logprobs)
        generation.machine = GenerationMachine(
            GenerationCore(
                clock=self._common.clock,
                owner=generation,
                coalesce_tokens=COALESCE_TOKENS,
                coalesce_ms=COALESCE_MS,
            )
        )
        self._generations[key] = generation
        self._on_start()
        engine_generation = self._common.engine.submit(request, generation.on_tokens)
        generation.engine_generation = engine_generation
        engine_generation.result.addCallbacks(generation.engine_finished, generation.engine_failed)

    def done(self, generation: NodeGeneration) -> None:
        if self._generations.get(generation.key) is generation:
            del self._generations[generation.key]
        self._on_end()

    def of_session(self, head: HeadSessions, session_id: int) -> list[NodeGeneration]:
        return [
            g
            for key, g in self._generations.items()
            if key.session_id == session_id and key.head_id == head.head_id
        ]

    def cancel_session(self, head: HeadSessions, session_id: int) -> None:
        """Cancel the generations of one session (it was fenced, revoked or deleted)."""
        for generation in self.of_session(head, session_id):
            generation.machine.cancel()

    def on_connection(self, connection: NodeConnection) -> list[NodeGeneration]:
        """The generations whose events go to ``connection``."""
        return [g for g in self._generations.values() if g.connection is connection]

    # DrainOwner

    def running_generation_keys(self) -> frozenset[GenerationKey]:
        return frozenset(self._generations)

    def cancel_generations(self) -> None:
        for generation in list(self._generations.values()):
            generation.machine.cancel()

    def unacked_events(self, keys: frozenset[GenerationKey]) -> int:
        return self._heads.unacked_events(keys)
