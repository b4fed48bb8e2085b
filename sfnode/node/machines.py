"""The node's state machines: connection handshake, session lease, one generation, the drain.

Each machine is built with Automat's typed API: inputs are a ``typing.Protocol``, the shared
state is a small core dataclass, a timer lives only in the data of the state that needs it, and
timers re-enter a machine only through its private inputs.  Every (state, input) pair a machine
accepts is listed in its transition table below, including the ones that deliberately do
nothing.  The machines decide *when*; the owner they are given (the node, ``sfnode.node.agent``)
decides *what* by consulting the session rules (``sfnode.node.sessions``) and sends.  A
machine's outputs are the only writers of the facts it decides (a session's ``fenced`` flag).

Nothing here touches a socket or reads a global clock: the clock is in the core.  A machine
never inspects another machine's state.  docs/protocol.md section 9 lists these transition
tables for readers of the protocol; section numbers in this module are those of docs/protocol.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from automat import TypeMachineBuilder
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from sfnode.generation import EngineStop, GenerationResult, TokenBatch
from sfnode.linkf.idempotency import GenerationKey, LeaseClock
from sfnode.linkf.wire import (
    FINISH_CANCELLED,
    FINISH_DETAIL_CLOSED,
    FINISH_EOS,
    FINISH_EXPIRED,
    FINISH_LENGTH,
    FINISH_REFUSED,
    Frame,
)

log = Logger()

Tracer = Callable[[str, str, str], None]
"""Called with (old state, input, new state) on every transition, for debugging."""


def _cancel(call: IDelayedCall | None) -> None:
    if call is not None and call.active():
        call.cancel()


def _seconds(ms: int) -> float:
    return ms / 1000.0


def trace_machine(machine: object, name: str, tracer: Tracer) -> None:
    """Report every transition of ``machine`` as ``tracer(old, input, new)``."""

    def on_transition(old: Any, input_name: str, new: Any) -> None:
        tracer(f"{name}[{old.name}]", input_name, f"[{new.name}]")

    machine.__automat_transitioner__.setTrace(on_transition)  # type: ignore[attr-defined]


# ============================================================================================
# Connection: handshake (docs/protocol.md 5.2), then serving with the idle timeout (7.1) and
# NODE_STATUS.


class ConnectionInputs(Protocol):
    def connected(self) -> None:
        """The transport is up; start waiting for HELLO."""

    def hello(self, frame: Frame) -> None:
        """A HELLO frame arrived (its payload not decoded yet: the owner's check does that)."""

    def frame(self, frame: Frame) -> None:
        """Any frame other than HELLO arrived."""

    def lost(self) -> None:
        """The transport is gone."""

    def _hello_accepted(self) -> None:
        """Private: the HELLO decoded and passed version, role and token checks."""

    def _hello_refused(self, reason: str) -> None:
        """Private: the HELLO was malformed or failed a check."""

    def _handshake_timed_out(self) -> None:
        """Private: no HELLO within the handshake timeout."""

    def _idle_timed_out(self) -> None:
        """Private: no frame within the idle timeout."""


class ConnectionOwner(Protocol):
    """What the connection machine asks of the connection it belongs to."""

    def check_hello(self, frame: Frame) -> str | None:
        """Decode the HELLO frame and check it: None when acceptable, else why not."""

    def send_hello_ack(self) -> None: ...

    def send_status(self) -> None: ...

    def serve(self, frame: Frame) -> None:
        """Handle one frame after the handshake (docs/protocol.md section 7.2)."""

    def close(self, reason: str) -> None:
        """Log ``reason`` and close the transport."""

    def ended(self) -> None:
        """The connection is over; release what it holds in shared state."""


@dataclass
class ConnectionCore:
    clock: IReactorTime
    owner: ConnectionOwner
    handshake_timeout_ms: int
    idle_timeout_ms: int
    status_interval_ms: int


@dataclass
class AwaitingHello:
    """Data of ``awaiting_hello``: the handshake deadline, if there is one."""

    deadline: IDelayedCall | None

    def stop(self) -> None:
        _cancel(self.deadline)


@dataclass
class Serving:
    """Data of ``serving``: the idle deadline and the NODE_STATUS loop."""

    idle: IDelayedCall | None
    status: LoopingCall

    def activity(self, core: ConnectionCore) -> None:
        if self.idle is not None and self.idle.active():
            self.idle.reset(_seconds(core.idle_timeout_ms))

    def stop(self) -> None:
        _cancel(self.idle)
        if self.status.running:
            self.status.stop()


def _awaiting_hello(inputs: ConnectionInputs, core: ConnectionCore) -> AwaitingHello:
    if core.handshake_timeout_ms == 0:
        return AwaitingHello(None)
    return AwaitingHello(
        core.clock.callLater(_seconds(core.handshake_timeout_ms), inputs._handshake_timed_out)
    )


def _serving(inputs: ConnectionInputs, core: ConnectionCore) -> Serving:
    idle = None
    if core.idle_timeout_ms:
        idle = core.clock.callLater(_seconds(core.idle_timeout_ms), inputs._idle_timed_out)
    status = LoopingCall(core.owner.send_status)
    status.clock = core.clock
    status.start(_seconds(core.status_interval_ms), now=False).addErrback(
        lambda failure: log.failure("NODE_STATUS loop failed", failure)
    )
    return Serving(idle, status)


_connection = TypeMachineBuilder(ConnectionInputs, ConnectionCore)
_c_new = _connection.state("new")
_c_awaiting = _connection.state("awaiting_hello", _awaiting_hello)
_c_serving = _connection.state("serving", _serving)
_c_closed = _connection.state("closed")


@_c_new.upon(ConnectionInputs.connected).to(_c_awaiting)
def _start_handshake(inputs: ConnectionInputs, core: ConnectionCore) -> None:
    pass


@_c_new.upon(ConnectionInputs.lost).to(_c_closed)
def _lost_before_start(inputs: ConnectionInputs, core: ConnectionCore) -> None:
    core.owner.ended()


@_c_awaiting.upon(ConnectionInputs.hello).loop()
def _check_hello(
    inputs: ConnectionInputs, core: ConnectionCore, data: AwaitingHello, frame: Frame
) -> None:
    reason = core.owner.check_hello(frame)
    if reason is None:
        inputs._hello_accepted()
    else:
        inputs._hello_refused(reason)


@_c_awaiting.upon(ConnectionInputs.frame).loop()
def _discard_before_hello(
    inputs: ConnectionInputs, core: ConnectionCore, data: AwaitingHello, frame: Frame
) -> None:
    """docs/protocol.md section 5.2: frames before HELLO are discarded."""


@_c_awaiting.upon(ConnectionInputs._hello_accepted).to(_c_serving)
def _answer_hello(inputs: ConnectionInputs, core: ConnectionCore, data: AwaitingHello) -> None:
    data.stop()
    core.owner.send_hello_ack()


@_c_awaiting.upon(ConnectionInputs._hello_refused).to(_c_closed)
def _refuse_hello(
    inputs: ConnectionInputs, core: ConnectionCore, data: AwaitingHello, reason: str
) -> None:
    data.stop()
    core.owner.close(f"refused the handshake: {reason}")
    core.owner.ended()


@_c_awaiting.upon(ConnectionInputs._handshake_timed_out).to(_c_closed)
def _drop_silent(inputs: ConnectionInputs, core: ConnectionCore, data: AwaitingHello) -> None:
    core.owner.close("dropped a silent connection (no HELLO within the handshake timeout)")
    core.owner.ended()


@_c_awaiting.upon(ConnectionInputs.lost).to(_c_closed)
def _lost_in_handshake(inputs: ConnectionInputs, core: ConnectionCore, data: AwaitingHello) -> None:
    data.stop()
    core.owner.ended()


@_c_serving.upon(ConnectionInputs.frame).loop()
def _serve(inputs: ConnectionInputs, core: ConnectionCore, data: Serving, frame: Frame) -> None:
    data.activity(core)
    core.owner.serve(frame)


@_c_serving.upon(ConnectionInputs.hello).loop()
def _hello_again(
    inputs: ConnectionInputs, core: ConnectionCore, data: Serving, frame: Frame
) -> None:
    """A HELLO after the handshake is ignored undecoded (docs/protocol.md section 4.1), but it
    is activity."""
    data.activity(core)


@_c_serving.upon(ConnectionInputs._idle_timed_out).to(_c_closed)
def _drop_idle(inputs: ConnectionInputs, core: ConnectionCore, data: Serving) -> None:
    data.stop()
    core.owner.close("dropped an idle connection")
    core.owner.ended()


@_c_serving.upon(ConnectionInputs.lost).to(_c_closed)
def _lost_while_serving(inputs: ConnectionInputs, core: ConnectionCore, data: Serving) -> None:
    data.stop()
    core.owner.ended()


@_c_closed.upon(ConnectionInputs.hello).loop()
def _closed_hello(inputs: ConnectionInputs, core: ConnectionCore, frame: Frame) -> None:
    """Bytes that were already buffered when the connection was closed: ignored."""


@_c_closed.upon(ConnectionInputs.frame).loop()
def _closed_frame(inputs: ConnectionInputs, core: ConnectionCore, frame: Frame) -> None:
    """Bytes that were already buffered when the connection was closed: ignored."""


_c_closed.upon(ConnectionInputs.lost).loop().returns(None)
_c_closed.upon(ConnectionInputs._idle_timed_out).loop().returns(None)
_c_closed.upon(ConnectionInputs._handshake_timed_out).loop().returns(None)

ConnectionMachine = _connection.build()


# ============================================================================================
# Session lease lifecycle (docs/protocol.md section 6.4, decision D3).


class LeasedSession(Protocol):
    """What the lease machine reads and writes of its session's record.

    The machine reads ``lease`` (the clock of the lease as received) to arm its timers, and its
    outputs are the only code that writes ``fenced``.
    """

    session_id: int
    lease: LeaseClock
    fenced: bool
    fenced_at: int
    """When it was last fenced, on the node's millisecond clock (written with ``fenced``)."""


class SessionInputs(Protocol):
    def assigned(self) -> None:
        """An accepted ASSIGN (re)started the lease: un-fence, arm the timers from the lease."""

    def granted(self) -> None:
        """An accepted LEASE_GRANT restarted the lease: re-arm the timers from the lease."""

    def superseded(self) -> None:
        """A RECONCILE named a higher epoch: fence quietly, keeping the context (6.5)."""

    def give_up(self, reason: str) -> None:
        """A bound was reached (issue 5): fence, and have the owner forget the context."""

    def stopped(self) -> None:
        """The session was revoked or the node stops: stop every timer (and un-fence nothing).

        A later ASSIGN starts the lease again (a node restarted on the same agent).
        """

    def _renew_due(self) -> None:
        """Private: the renew window opened, or another D3 interval passed in it."""

    def _expired(self) -> None:
        """Private: the lease ran out."""

    def _orphaned(self) -> None:
        """Private: the session stayed fenced for the grace period (docs/protocol.md 6.4)."""


class SessionOwner(Protocol):
    """What the lease machine asks of the node; each call names the session it is about."""

    def send_renew(self, session_id: int) -> None:
        """Ask the head for a LEASE_GRANT of this session."""

    def self_fenced(self, session_id: int) -> None:
        """The session's lease expired and it is now fenced: forget its context (6.4)."""

    def gave_up(self, session_id: int, reason: str) -> None:
        """The node fenced the session because of ``reason``: forget its context."""

    def orphaned(self, session_id: int) -> None:
        """The session stayed fenced for the whole grace period: delete its record, commands,
        generations and unacknowledged events (the machine has no timer left)."""


@dataclass
class SessionCore:
    clock: IReactorTime
    now_ms: Callable[[], int]
    """The node's monotonic milliseconds: the time base of the lease clock."""
    owner: SessionOwner
    session: LeasedSession
    renew_interval_ms: int
    grace_ms: int = 0
    """How long a fenced session is kept for its head to come back (0: no time limit)."""


@dataclass
class LeaseTimers:
    """Data of ``held``: the next renew request and the expiry.

    Both are armed from the lease when it starts; afterwards the renew timer repeats every
    renew interval (D3) and the expiry stays where the lease put it.
    """

    renew: IDelayedCall
    expiry: IDelayedCall

    def stop(self) -> None:
        _cancel(self.renew)
        _cancel(self.expiry)


def _held(inputs: SessionInputs, core: SessionCore) -> LeaseTimers:
    lease, now = core.session.lease, core.now_ms()
    return LeaseTimers(
        renew=core.clock.callLater(_seconds(lease.renew_in(now)), inputs._renew_due),
        expiry=core.clock.callLater(_seconds(lease.expires_in(now)), inputs._expired),
    )


@dataclass
class GraceTimer:
    """Data of ``fenced``: when the fenced session is deleted unless a new ASSIGN comes first
    (None: kept without a time limit)."""

    deadline: IDelayedCall | None

    def stop(self) -> None:
        _cancel(self.deadline)


def _fenced(inputs: SessionInputs, core: SessionCore, reason: str = "") -> GraceTimer:
    # (``reason`` is give_up's: every input that enters the state passes its own arguments.)
    core.session.fenced = True
    core.session.fenced_at = core.now_ms()
    if not core.grace_ms:
        return GraceTimer(None)
    return GraceTimer(core.clock.callLater(_seconds(core.grace_ms), inputs._orphaned))


_session = TypeMachineBuilder(SessionInputs, SessionCore)
_s_unleased = _session.state("unleased")
_s_held = _session.state("held", _held)
_s_fenced = _session.state("fenced", _fenced)


@_s_unleased.upon(SessionInputs.assigned).to(_s_held)
def _first_lease(inputs: SessionInputs, core: SessionCore) -> None:
    core.session.fenced = False


@_s_fenced.upon(SessionInputs.assigned).to(_s_held)
def _unfence(inputs: SessionInputs, core: SessionCore, data: GraceTimer) -> None:
    data.stop()
    core.session.fenced = False
    log.info("session {session} un-fenced by a new lease", session=core.session.session_id)


@_s_fenced.upon(SessionInputs._orphaned).to(_s_unleased)
def _orphan(inputs: SessionInputs, core: SessionCore, data: GraceTimer) -> None:
    core.owner.orphaned(core.session.session_id)


def _rearm(inputs: SessionInputs, core: SessionCore, data: LeaseTimers) -> None:
    # A loop keeps the state's data (no factory runs), so the timers are re-armed in place.
    data.stop()
    fresh = _held(inputs, core)
    data.renew, data.expiry = fresh.renew, fresh.expiry


_s_held.upon(SessionInputs.assigned).loop()(_rearm)
_s_held.upon(SessionInputs.granted).loop()(_rearm)


# Entering ``fenced`` sets the flag and arms the grace timer (its data factory, _fenced).


@_s_held.upon(SessionInputs._expired).to(_s_fenced)
def _lease_expired(inputs: SessionInputs, core: SessionCore, data: LeaseTimers) -> None:
    data.stop()
    core.owner.self_fenced(core.session.session_id)


@_s_held.upon(SessionInputs.superseded).to(_s_fenced)
def _superseded(inputs: SessionInputs, core: SessionCore, data: LeaseTimers) -> None:
    data.stop()


@_s_held.upon(SessionInputs.give_up).to(_s_fenced)
def _given_up(inputs: SessionInputs, core: SessionCore, data: LeaseTimers, reason: str) -> None:
    data.stop()
    core.owner.gave_up(core.session.session_id, reason)


@_s_held.upon(SessionInputs.stopped).to(_s_unleased)
def _stop_leased(inputs: SessionInputs, core: SessionCore, data: LeaseTimers) -> None:
    data.stop()


@_s_held.upon(SessionInputs._renew_due).loop()
def _ask_for_renewal(inputs: SessionInputs, core: SessionCore, data: LeaseTimers) -> None:
    core.owner.send_renew(core.session.session_id)
    data.renew = core.clock.callLater(_seconds(core.renew_interval_ms), inputs._renew_due)


@_s_unleased.upon(SessionInputs.superseded).to(_s_fenced)
def _superseded_unleased(inputs: SessionInputs, core: SessionCore) -> None:
    pass


@_s_unleased.upon(SessionInputs.give_up).to(_s_fenced)
def _given_up_unleased(inputs: SessionInputs, core: SessionCore, reason: str) -> None:
    core.owner.gave_up(core.session.session_id, reason)


@_s_fenced.upon(SessionInputs.stopped).to(_s_unleased)
def _stop_fenced(inputs: SessionInputs, core: SessionCore, data: GraceTimer) -> None:
    data.stop()


# Deliberately quiet pairs: a grant never reaches a session without a lease or a fenced one (the
# session rules refuse it first); fencing a fenced session changes nothing (its grace period
# runs on from the first fence); stopping a machine without timers changes nothing.
_s_unleased.upon(SessionInputs.granted).loop().returns(None)
_s_unleased.upon(SessionInputs.stopped).loop().returns(None)


@_s_fenced.upon(SessionInputs.granted).loop()
@_s_fenced.upon(SessionInputs.superseded).loop()
def _already_fenced_quietly(inputs: SessionInputs, core: SessionCore, data: GraceTimer) -> None:
    pass


@_s_fenced.upon(SessionInputs.give_up).loop()
def _already_fenced(
    inputs: SessionInputs, core: SessionCore, data: GraceTimer, reason: str
) -> None:
    pass


SessionMachine = _session.build()


# ============================================================================================
# One generation on the node (docs/protocol.md section 7.3 with decision D2): coalescing, cancel,
# fence, finish.


class GenerationInputs(Protocol):
    def tokens(self, batch: TokenBatch) -> None:
        """The engine handed over new tokens (with one logprob each, when the generation
        asked for them: docs/protocol.md section 12.1)."""

    def cancel(self) -> None:
        """GENERATE_CANCEL for this generation arrived."""

    def finished(self, result: GenerationResult) -> None:
        """The engine ended the generation."""

    def refused(self) -> None:
        """The engine refused the request (a client refusal: StreamTooLong)."""

    def failed(self, reason: str) -> None:
        """The engine failed the generation."""

    def _flush_due(self) -> None:
        """Private: the coalescing interval passed with tokens pending."""

    def _fenced(self) -> None:
        """Private: an emit was refused (the session is fenced or superseded)."""


class GenerationOwner(Protocol):
    def emit_tokens(self, batch: TokenBatch) -> bool:
        """Emit one Tokens event (TokensLogprobs when the batch carries logprobs); False when
        the session refuses (fenced or superseded)."""

    def emit_finish(self, reason: int, detail: int = 0) -> None:
        """Emit the Finish (``detail``: its bits, docs/protocol.md section 12.6)."""

    def stop_engine(self) -> None: ...

    def fail(self, reason: str) -> None:
        """The engine failed: close the asking connection (docs/protocol.md section 7.4)."""

    def done(self) -> None:
        """The generation is over: forget it."""


@dataclass
class GenerationCore:
    clock: IReactorTime
    owner: GenerationOwner
    coalesce_tokens: int
    coalesce_ms: int
    pending: list[TokenBatch] = field(default_factory=list)
    """The batches not sent yet (their logprobs travel with them, never apart)."""
    pending_tokens: int = 0
    last_flush: float = 0.0

    def collect(self, batch: TokenBatch) -> None:
        if batch.tokens:
            self.pending.append(batch)
            self.pending_tokens += len(batch)

    def discard(self) -> None:
        self.pending.clear()
        self.pending_tokens = 0

    def flush(self, inputs: GenerationInputs) -> None:
        if not self.pending:
            return
        batches, self.pending = self.pending, []
        self.pending_tokens = 0
        self.last_flush = self.clock.seconds()
        if not self.owner.emit_tokens(TokenBatch.join(batches)):
            inputs._fenced()


@dataclass
class Coalescing:
    """Data of ``running``: the timer that flushes pending tokens 200 ms after the last flush."""

    flush_call: IDelayedCall | None = None

    def stop(self) -> None:
        _cancel(self.flush_call)
        self.flush_call = None


def _running(inputs: GenerationInputs, core: GenerationCore, batch: TokenBatch) -> Coalescing:
    core.last_flush = core.clock.seconds()
    return Coalescing()


_FINISH_OF_STOP = {
    EngineStop.EOS: FINISH_EOS,
    EngineStop.LENGTH: FINISH_LENGTH,
    EngineStop.EXPIRED: FINISH_EXPIRED,
    EngineStop.CANCELLED: FINISH_CANCELLED,
}


def _finish_of(result: GenerationResult) -> tuple[int, int]:
    """The Finish's reason and detail of how the engine ended a generation."""
    return _FINISH_OF_STOP[result.stop], FINISH_DETAIL_CLOSED if result.closed else 0


_generation = TypeMachineBuilder(GenerationInputs, GenerationCore)
_g_new = _generation.state("new")
_g_running = _generation.state("running", _running)
_g_cancelling = _generation.state("cancelling")
_g_fenced = _generation.state("fenced")
_g_done = _generation.state("done")


@_g_new.upon(GenerationInputs.tokens).to(_g_running)
def _first_tokens(inputs: GenerationInputs, core: GenerationCore, batch: TokenBatch) -> None:
    # The first tokens go out at once: holding them for the coalescing window would add up to
    # 200 ms to every time-to-first-token.  Coalescing starts from this flush.
    core.collect(batch)
    core.flush(inputs)


@_g_running.upon(GenerationInputs.tokens).loop()
def _collect(
    inputs: GenerationInputs, core: GenerationCore, data: Coalescing, batch: TokenBatch
) -> None:
    core.collect(batch)
    if core.pending_tokens >= core.coalesce_tokens:
        data.stop()
        core.flush(inputs)
    elif data.flush_call is None:
        delay = max(0.0, core.last_flush + _seconds(core.coalesce_ms) - core.clock.seconds())
        data.flush_call = core.clock.callLater(delay, inputs._flush_due)


@_g_running.upon(GenerationInputs._flush_due).loop()
def _flush_on_time(inputs: GenerationInputs, core: GenerationCore, data: Coalescing) -> None:
    data.flush_call = None
    core.flush(inputs)


@_g_running.upon(GenerationInputs.cancel).to(_g_cancelling)
def _cancel_running(inputs: GenerationInputs, core: GenerationCore, data: Coalescing) -> None:
    data.stop()
    core.flush(inputs)
    core.owner.stop_engine()


@_g_running.upon(GenerationInputs._fenced).to(_g_fenced)
def _fence_running(inputs: GenerationInputs, core: GenerationCore, data: Coalescing) -> None:
    data.stop()
    core.discard()
    core.owner.stop_engine()


@_g_running.upon(GenerationInputs.finished).to(_g_done)
def _finish_running(
    inputs: GenerationInputs, core: GenerationCore, data: Coalescing, result: GenerationResult
) -> None:
    data.stop()
    core.flush(inputs)
    core.owner.emit_finish(*_finish_of(result))
    core.owner.done()


@_g_running.upon(GenerationInputs.failed).to(_g_done)
def _fail_running(
    inputs: GenerationInputs, core: GenerationCore, data: Coalescing, reason: str
) -> None:
    data.stop()
    core.owner.fail(reason)
    core.owner.done()


@_g_new.upon(GenerationInputs.cancel).to(_g_cancelling)
def _cancel_new(inputs: GenerationInputs, core: GenerationCore) -> None:
    core.owner.stop_engine()


@_g_new.upon(GenerationInputs.finished).to(_g_done)
def _finish_new(inputs: GenerationInputs, core: GenerationCore, result: GenerationResult) -> None:
    core.owner.emit_finish(*_finish_of(result))
    core.owner.done()


@_g_new.upon(GenerationInputs.refused).to(_g_done)
def _refuse_new(inputs: GenerationInputs, core: GenerationCore) -> None:
    core.owner.emit_finish(FINISH_REFUSED)
    core.owner.done()


def _fail(inputs: GenerationInputs, core: GenerationCore, reason: str) -> None:
    core.owner.fail(reason)
    core.owner.done()


def _end_cancelled(
    inputs: GenerationInputs, core: GenerationCore, result: GenerationResult | None = None
) -> None:
    """However the engine ends a cancelled generation, its Finish says cancelled."""
    core.owner.emit_finish(FINISH_CANCELLED)
    core.owner.done()


def _end_fenced(
    inputs: GenerationInputs, core: GenerationCore, result: GenerationResult | None = None
) -> None:
    """A fenced generation sends no Finish (docs/protocol.md section 7.3)."""
    core.owner.done()


for _ended_state in (_g_new, _g_cancelling, _g_fenced):
    _ended_state.upon(GenerationInputs.failed).to(_g_done)(_fail)
_g_cancelling.upon(GenerationInputs.finished).to(_g_done)(_end_cancelled)
_g_cancelling.upon(GenerationInputs.refused).to(_g_done)(_end_cancelled)
_g_fenced.upon(GenerationInputs.finished).to(_g_done)(_end_fenced)
_g_fenced.upon(GenerationInputs.refused).to(_g_done)(_end_fenced)


# Deliberately quiet pairs: tokens after a stop are never sent; repeated cancels and stale
# timers do nothing.
@_g_cancelling.upon(GenerationInputs.tokens).loop()
def _drop_after_cancel(inputs: GenerationInputs, core: GenerationCore, batch: TokenBatch) -> None:
    pass


@_g_fenced.upon(GenerationInputs.tokens).loop()
def _drop_after_fence(inputs: GenerationInputs, core: GenerationCore, batch: TokenBatch) -> None:
    pass


@_g_done.upon(GenerationInputs.tokens).loop()
def _drop_after_done(inputs: GenerationInputs, core: GenerationCore, batch: TokenBatch) -> None:
    pass


_g_new.upon(GenerationInputs._fenced).to(_g_fenced).returns(None)
for _quiet_state in (_g_cancelling, _g_fenced, _g_done):
    _quiet_state.upon(GenerationInputs.cancel).loop().returns(None)
    _quiet_state.upon(GenerationInputs._fenced).loop().returns(None)
    _quiet_state.upon(GenerationInputs._flush_due).loop().returns(None)
_g_done.upon(GenerationInputs.finished).loop().returns(None)
_g_done.upon(GenerationInputs.refused).loop().returns(None)
_g_done.upon(GenerationInputs.failed).loop().returns(None)

GenerationMachine = _generation.build()


# ============================================================================================
# Drain on SIGTERM (issue 5): decline new generations, let the running ones finish or cancel
# them at the timeout, then wait briefly for the heads' acknowledgements.


class DrainInputs(Protocol):
    def drain(self) -> Deferred[None]:
        """Start the drain, or join the one under way; fires once the node is drained."""

    def accepting(self) -> bool:
        """Whether a new generation may start: True until the drain starts."""

    def generation_done(self) -> None:
        """A generation ended (the node may have none left)."""

    def acked(self) -> None:
        """A WATERMARK_ACK arrived (the final events may all be acknowledged now)."""

    def stopped(self) -> None:
        """The node stops: end a drain under way now (its waiters fire, its timer stops)."""

    def _generations_over(self) -> None:
        """Private: no generation is left running."""

    def _settled(self) -> None:
        """Private: every event of the drained generations is acknowledged."""

    def _timed_out(self) -> None:
        """Private: the drain timeout, or the wait for acknowledgements, ran out."""


class DrainOwner(Protocol):
    """What the drain machine asks of the node."""

    def running_generation_keys(self) -> frozenset[GenerationKey]:
        """The generations running or queued now."""

    def cancel_generations(self) -> None:
        """Cancel every running generation (each still sends its CANCELLED Finish)."""

    def unacked_events(self, keys: frozenset[GenerationKey]) -> int:
        """Events of these generations still waiting for a WATERMARK_ACK."""


@dataclass
class DrainCore:
    clock: IReactorTime
    owner: DrainOwner
    drain_timeout_ms: int
    ack_wait_ms: int
    keys: frozenset[GenerationKey] = frozenset()
    """The generations that ran when the drain started: the ones whose acks it waits for."""
    waiters: list[Deferred[None]] = field(default_factory=list)

    def join(self) -> Deferred[None]:
        waiter: Deferred[None] = Deferred()
        self.waiters.append(waiter)
        return waiter


@dataclass
class DrainTimer:
    """Data of ``finishing`` and ``settling``: the deadline of that phase."""

    call: IDelayedCall

    def stop(self) -> None:
        _cancel(self.call)


def _finishing(inputs: DrainInputs, core: DrainCore) -> DrainTimer:
    return DrainTimer(core.clock.callLater(_seconds(core.drain_timeout_ms), inputs._timed_out))


def _settling(inputs: DrainInputs, core: DrainCore) -> DrainTimer:
    return DrainTimer(core.clock.callLater(_seconds(core.ack_wait_ms), inputs._timed_out))


_drain = TypeMachineBuilder(DrainInputs, DrainCore)
_d_serving = _drain.state("serving")
_d_finishing = _drain.state("finishing", _finishing)
_d_settling = _drain.state("settling", _settling)
_d_drained = _drain.state("drained")


@_d_serving.upon(DrainInputs.drain).to(_d_finishing)
def _start_drain(inputs: DrainInputs, core: DrainCore) -> Deferred[None]:
    core.keys = core.owner.running_generation_keys()
    log.info(
        "draining: declining new generations, letting {count} running ones finish "
        "(up to {timeout} s)",
        count=len(core.keys),
        timeout=_seconds(core.drain_timeout_ms),
    )
    if not core.keys:
        inputs._generations_over()
    return core.join()


@_d_finishing.upon(DrainInputs.drain).loop()
def _join_finishing(inputs: DrainInputs, core: DrainCore, data: DrainTimer) -> Deferred[None]:
    return core.join()


@_d_settling.upon(DrainInputs.drain).loop()
def _join_settling(inputs: DrainInputs, core: DrainCore, data: DrainTimer) -> Deferred[None]:
    return core.join()


@_d_drained.upon(DrainInputs.drain).loop()
def _already_drained(inputs: DrainInputs, core: DrainCore) -> Deferred[None]:
    return succeed(None)


_d_serving.upon(DrainInputs.accepting).loop().returns(True)
for _draining_state in (_d_finishing, _d_settling, _d_drained):
    _draining_state.upon(DrainInputs.accepting).loop().returns(False)


@_d_finishing.upon(DrainInputs.generation_done).loop()
def _one_finished(inputs: DrainInputs, core: DrainCore, data: DrainTimer) -> None:
    if not core.owner.running_generation_keys():
        inputs._generations_over()


@_d_finishing.upon(DrainInputs._timed_out).loop()
def _drain_timed_out(inputs: DrainInputs, core: DrainCore, data: DrainTimer) -> None:
    log.warn(
        "drain timeout: cancelling {count} generations that are still running",
        count=len(core.owner.running_generation_keys()),
    )
    core.owner.cancel_generations()


@_d_finishing.upon(DrainInputs._generations_over).to(_d_settling)
def _await_acks(inputs: DrainInputs, core: DrainCore, data: DrainTimer) -> None:
    data.stop()
    if not core.owner.unacked_events(core.keys):
        inputs._settled()


@_d_settling.upon(DrainInputs.acked).loop()
def _an_ack(inputs: DrainInputs, core: DrainCore, data: DrainTimer) -> None:
    if not core.owner.unacked_events(core.keys):
        inputs._settled()


def _finish_drain(core: DrainCore) -> None:
    log.info(
        "drained: {left} events left unacknowledged", left=core.owner.unacked_events(core.keys)
    )
    core.keys = frozenset()
    waiters, core.waiters = core.waiters, []
    for waiter in waiters:
        waiter.callback(None)


for _settle_input in (DrainInputs._settled, DrainInputs._timed_out):

    @_d_settling.upon(_settle_input).to(_d_drained)
    def _drained(inputs: DrainInputs, core: DrainCore, data: DrainTimer) -> None:
        data.stop()
        _finish_drain(core)


for _running_state in (_d_finishing, _d_settling):

    @_running_state.upon(DrainInputs.stopped).to(_d_drained)
    def _stopped_draining(inputs: DrainInputs, core: DrainCore, data: DrainTimer) -> None:
        data.stop()
        _finish_drain(core)


# Deliberately quiet pairs: generations and acks matter only in the phase that waits for them.
_d_serving.upon(DrainInputs.generation_done).loop().returns(None)
_d_serving.upon(DrainInputs.acked).loop().returns(None)
_d_serving.upon(DrainInputs.stopped).loop().returns(None)
_d_finishing.upon(DrainInputs.acked).loop().returns(None)
_d_settling.upon(DrainInputs.generation_done).loop().returns(None)
for _quiet_drain in (DrainInputs.generation_done, DrainInputs.acked, DrainInputs.stopped):
    _d_drained.upon(_quiet_drain).loop().returns(None)

DrainMachine = _drain.build()
