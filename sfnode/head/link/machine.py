"""The state machine of the head's link to one node (docs/protocol.md sections 5 and 8).

::

    new ---start---> connecting ---connection_made---> handshaking ---acknowledged---> open
                      ^    ^                              |                            ^  |
                      |    |         acknowledged_with_sessions --> reconciling ------/   |
                      |    |                              |               |              |
                      |    +--- _retry_due --- down <-- attempt failed ---+              |
                      +------------------------------------ connection_lost -------------+

    close (from any state) --> closed

A link the head dials redials by itself: at once when an open connection drops, then after
each failed attempt with the delays of its retry policy (:func:`retry_policy`: jittered, from
about 0.1 s doubling up to a cap), like Twisted's ``ClientService``.  A link a node dialed in
ends (``closed``) when its connection does; the node redials.

The machine owns its timers, each in the data of the one state that needs it: the connect
deadline (``connecting``), the handshake deadline (``handshaking``), the reconcile deadline
(``reconciling``), the KEEPALIVE sender and the silence deadline (``open``: a node that sends
nothing for the keepalive window, although nodes report their status every 2 s, is treated as
gone), and the redial timer (``down``).  Timers re-enter the machine only through its private
inputs.  Every (state, input) pair it accepts is listed in the tables below, including the
ones that deliberately do nothing.

This module must never touch a socket or read a global clock: every effect goes through
:class:`LinkEffects` (which :class:`~sfnode.head.link.NodeLink` implements), and the clock is in
the core.  Every input returns None, so any of them may be called from inside another's effects.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from automat import TypeMachineBuilder
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime

from sfnode.linkf import backoff
from sfnode.linkf.backoff import RetryPolicy as RetryPolicy

RETRY_INITIAL_S = 0.1
"""The delay before the first redial after a failed attempt."""
RETRY_FACTOR = 2.0
DEFAULT_RETRY_MAX_S = 10.0
"""The longest wait between two redials of a node that stays unreachable."""
DEFAULT_KEEPALIVE_INTERVAL_S = 15.0
"""A KEEPALIVE goes out on an open link this often (docs/protocol.md section 8)."""
DEFAULT_SILENCE_TIMEOUT_S = 10.0
"""An open link that brought nothing for this long is dropped (nodes report every 2 s)."""


def retry_policy(
    cap_s: float = DEFAULT_RETRY_MAX_S, *, jitter: Callable[[], float] = random.random
) -> RetryPolicy:
    """The head's redial delays: :func:`sfnode.linkf.backoff.retry_policy` from
    ``RETRY_INITIAL_S`` up to ``cap_s`` (``--reconnect-max``)."""
    return backoff.retry_policy(
        cap_s, initial_s=RETRY_INITIAL_S, factor=RETRY_FACTOR, jitter=jitter
    )


class LinkError(Exception):
    """Something went wrong on a head's link to a node."""


class LinkLostError(LinkError):
    """The connection is gone; calls that depended on it cannot complete on it."""


class NodeSilentError(LinkLostError):
    """The node sent nothing for the keepalive window (hung, or the path to it is)."""


class HandshakeError(LinkError):
    """The link never got past HELLO / HELLO_ACK_F."""


class ConnectError(HandshakeError):
    """No connection could be made (refused, timed out, no route, ...)."""


class HandshakeTimeoutError(HandshakeError):
    """No HELLO_ACK_F arrived within the handshake timeout."""


class NodeRefusedError(HandshakeError):
    """The node closed the connection during the handshake (it refused the head)."""


class ReconcileError(LinkError):
    """A reconnect's RECONCILE did not complete."""


class LinkEffects(Protocol):
    """What the machine asks of the link it drives; none of these may block or raise."""

    def dial(self) -> Deferred[Any] | None:
        """Start one connection attempt; None when the link cannot dial (a node dialed in and
        its connection is being made)."""

    def attach(self) -> None:
        """Adopt the connection just made as the link's own and say HELLO on it."""

    def reject(self) -> None:
        """Abort a connection that was made when none was expected."""

    def abort(self) -> None:
        """Detach the link's connection, if it has one, and abort it."""

    def begin_reconcile(self) -> None:
        """Send RECONCILE on the new connection (section 6.5) and start waiting for its ack."""

    def opened(self, reconnected: bool) -> None:
        """The link is open: handshaken, and reconciled when it had sessions."""

    def attempt_failed(self, reason: LinkError, retry_in_s: float) -> None:
        """A connection attempt failed (connecting, handshake or reconcile); the next one
        starts in ``retry_in_s`` seconds."""

    def dropped(self, reason: LinkError) -> None:
        """The open link's connection ended (it was detached already)."""

    def replaced(self) -> None:
        """The open link's connection is dropped on purpose to dial a new one."""

    def silent(self, seconds: float) -> None:
        """Nothing arrived on the open link for ``seconds``: abort it and report it lost."""

    def send_keepalive(self) -> None:
        """Send one KEEPALIVE."""

    def closed(self) -> None:
        """The link is closed for good."""


class LinkInputs(Protocol):
    def start(self) -> None:
        """Dial (a new or down link); a link that is already on its way ignores it."""

    def redial(self) -> None:
        """Dial now; an open link drops its connection first (a forced reconnect)."""

    def connection_made(self) -> None:
        """A connection for this link was made (dialed, or a node dialing in)."""

    def dial_failed(self, reason: LinkError) -> None:
        """The connection attempt failed before a connection was made."""

    def handshake_failed(self, reason: LinkError) -> None:
        """The handshake cannot succeed (a first frame other than HELLO_ACK_F, bad bytes)."""

    def acknowledged(self) -> None:
        """HELLO_ACK_F arrived and the link holds no sessions: it is open."""

    def acknowledged_with_sessions(self) -> None:
        """HELLO_ACK_F arrived and the link holds sessions: reconcile them first."""

    def reconciled(self) -> None:
        """Every retransmission the RECONCILE_ACK announced has arrived."""

    def reconcile_failed(self, reason: LinkError) -> None:
        """The reconcile cannot complete (bad bytes, an unreasonable retry range)."""

    def connection_lost(self, reason: LinkError) -> None:
        """The connection of a link the head dials ended (it was detached already)."""

    def connection_ended(self, reason: LinkError) -> None:
        """The connection of a link a node dialed in ended: the link is over."""

    def wait_open(self) -> None:
        """Settle the waiters in ``core.open_waiters`` now if the state says how."""

    def close(self) -> None:
        """Close the link for good."""

    def _timed_out(self, reason: LinkError) -> None:
        """Private: the deadline of connecting, handshaking or reconciling passed."""

    def _retry_due(self) -> None:
        """Private: the redial timer of ``down`` fired."""

    def _keepalive_due(self) -> None:
        """Private: time for the next KEEPALIVE."""

    def _deadline_due(self) -> None:
        """Private: time to check whether the node went silent."""


@dataclass
class LinkCore:
    """State shared by every state of the machine."""

    effects: LinkEffects
    clock: IReactorTime
    retry: RetryPolicy
    handshake_timeout_s: float
    """Bounds each step of an attempt: connecting, the handshake, the reconcile."""
    keepalive_interval_s: float = DEFAULT_KEEPALIVE_INTERVAL_S
    silence_timeout_s: float = DEFAULT_SILENCE_TIMEOUT_S
    """0: a silent node is never dropped for its silence."""
    failures: int = 0
    """Failed attempts since the link was last open."""
    ever_open: bool = False
    last_heard: float = 0.0
    """When the node last sent anything (the owner sets it on every message)."""
    last_reason: LinkError | None = None
    """Why the link last went down."""
    retry_in_s: float = 0.0
    """The delay of the redial timer ``down`` set last."""
    open_waiters: list[Deferred[None]] = field(default_factory=list)
    """Waiters for the link to be open; fired by the machine only."""
    phase: str = "new"
    """new, connecting, handshaking, reconciling, open, down or closed: written by the machine
    only, before it asks for the effects of the phase it enters, and read by everyone else
    (the link's ``status``, whether it is open, whether its connection is past the
    handshake)."""

    def settle(self, error: LinkError | None) -> None:
        waiters, self.open_waiters = self.open_waiters, []
        for d in waiters:
            if error is None:
                d.callback(None)
            else:
                d.errback(error)


def _cancel(call: IDelayedCall | None) -> None:
    if call is not None and call.active():
        call.cancel()


@dataclass
class Dialing:
    """Data of ``connecting``: the attempt (None for a node dialing in) and its deadline."""

    attempt: Deferred[Any] | None
    deadline: IDelayedCall

    def stop(self) -> None:
        _cancel(self.deadline)

    def abandon(self) -> None:
        self.stop()
        attempt, self.attempt = self.attempt, None
        if attempt is not None and not attempt.called:
            attempt.cancel()


@dataclass
class Deadline:
    """Data of ``handshaking`` and ``reconciling``: the step's deadline."""

    deadline: IDelayedCall

    def stop(self) -> None:
        _cancel(self.deadline)


@dataclass
class Open:
    """Data of ``open``: the KEEPALIVE timer and the silence deadline."""

    keepalive: IDelayedCall
    silence: IDelayedCall | None

    def stop(self) -> None:
        _cancel(self.keepalive)
        _cancel(self.silence)


@dataclass
class Waiting:
    """Data of ``down``: the redial timer."""

    retry: IDelayedCall
    delay_s: float

    def stop(self) -> None:
        _cancel(self.retry)


def _connecting(inputs: LinkInputs, core: LinkCore, reason: LinkError | None = None) -> Dialing:
    deadline = core.clock.callLater(
        core.handshake_timeout_s,
        inputs._timed_out,
        ConnectError(f"timed out connecting after {core.handshake_timeout_s:g} s"),
    )
    core.phase = "connecting"
    return Dialing(core.effects.dial(), deadline)


def _handshaking(inputs: LinkInputs, core: LinkCore) -> Deadline:
    return Deadline(
        core.clock.callLater(
            core.handshake_timeout_s,
            inputs._timed_out,
            HandshakeTimeoutError(
                f"no HELLO_ACK_F within {core.handshake_timeout_s:g} s: the handshake timed out"
            ),
        )
    )


def _reconciling(inputs: LinkInputs, core: LinkCore) -> Deadline:
    return Deadline(
        core.clock.callLater(
            core.handshake_timeout_s,
            inputs._timed_out,
            ReconcileError(f"the reconcile timed out after {core.handshake_timeout_s:g} s"),
        )
    )


def _open(inputs: LinkInputs, core: LinkCore) -> Open:
    core.last_heard = core.clock.seconds()
    silence = None
    if core.silence_timeout_s > 0:
        silence = core.clock.callLater(core.silence_timeout_s, inputs._deadline_due)
    return Open(core.clock.callLater(core.keepalive_interval_s, inputs._keepalive_due), silence)


def _down(inputs: LinkInputs, core: LinkCore, reason: LinkError) -> Waiting:
    core.failures += 1
    core.last_reason = reason
    delay = core.retry_in_s = core.retry(core.failures)
    return Waiting(core.clock.callLater(delay, inputs._retry_due), delay)


_link = TypeMachineBuilder(LinkInputs, LinkCore)
_new = _link.state("new")
_connecting_state = _link.state("connecting", _connecting)
_handshaking_state = _link.state("handshaking", _handshaking)
_reconciling_state = _link.state("reconciling", _reconciling)
_open_state = _link.state("open", _open)
_down_state = _link.state("down", _down)
_closed = _link.state("closed")


def _enter_closed(core: LinkCore, *, was_open: bool = False) -> None:
    """Enter ``closed``: why the link is down becomes the head's close when it was open (or
    never had another reason), and the link's effects of closing follow."""
    if core.last_reason is None or was_open:
        core.last_reason = LinkLostError("the head closed the link")
    core.phase = "closed"
    core.effects.closed()


def _ignore(state: Any, *inputs: Callable[..., None]) -> None:
    """Inputs that ``state`` accepts and deliberately does nothing about (late or stray)."""
    for each in inputs:
        state.upon(each).loop().returns(None)


def _closed_error() -> LinkLostError:
    return LinkLostError("the link is closed")


@runtime_checkable
class _Timers(Protocol):
    """A state's data that holds timers."""

    def stop(self) -> None: ...


def _reject_stray(inputs: LinkInputs, core: LinkCore, data: _Timers) -> None:
    """A connection made while the link has one, or does not wait for one: refused."""
    core.effects.reject()


def _close_timed(inputs: LinkInputs, core: LinkCore, data: _Timers) -> None:
    """``close`` in a state with timers (not ``open``): they stop, waiters fail, closed."""
    data.stop()
    core.settle(_closed_error())
    _enter_closed(core)


# --------------------------------------------------------------------------------------------
# new


_new.upon(LinkInputs.start).to(_connecting_state).returns(None)
_new.upon(LinkInputs.redial).to(_connecting_state).returns(None)


@_new.upon(LinkInputs.connection_made).loop()
def _new_stray(inputs: LinkInputs, core: LinkCore) -> None:
    core.effects.reject()


@_new.upon(LinkInputs.wait_open).loop()
def _new_wait(inputs: LinkInputs, core: LinkCore) -> None:
    core.settle(LinkLostError("the link was never started"))


@_new.upon(LinkInputs.close).to(_closed)
def _new_close(inputs: LinkInputs, core: LinkCore) -> None:
    core.settle(_closed_error())
    _enter_closed(core)


_ignore(
    _new,
    LinkInputs.dial_failed,
    LinkInputs.handshake_failed,
    LinkInputs.reconcile_failed,
    LinkInputs.connection_lost,
    LinkInputs.connection_ended,
)


# --------------------------------------------------------------------------------------------
# connecting


@_connecting_state.upon(LinkInputs.connection_made).to(_handshaking_state)
def _connected(inputs: LinkInputs, core: LinkCore, data: Dialing) -> None:
    data.stop()
    core.phase = "handshaking"
    core.effects.attach()


@_connecting_state.upon(LinkInputs.dial_failed).to(_down_state)
def _dial_failed(inputs: LinkInputs, core: LinkCore, data: Dialing, reason: LinkError) -> None:
    data.stop()
    _report_failure(core, reason)


@_connecting_state.upon(LinkInputs._timed_out).to(_down_state)
def _connect_timed_out(
    inputs: LinkInputs, core: LinkCore, data: Dialing, reason: LinkError
) -> None:
    # The cancelled attempt still fails (dial_failed), which ``down`` ignores.
    data.abandon()
    _report_failure(core, reason)


@_connecting_state.upon(LinkInputs.close).to(_closed)
def _close_connecting(inputs: LinkInputs, core: LinkCore, data: Dialing) -> None:
    data.abandon()
    core.settle(_closed_error())
    _enter_closed(core)


_ignore(
    _connecting_state,
    LinkInputs.start,
    LinkInputs.redial,
    LinkInputs.wait_open,
)
_ignore(
    _connecting_state,
    LinkInputs.handshake_failed,
    LinkInputs.reconcile_failed,
    LinkInputs.connection_lost,
    LinkInputs.connection_ended,
)


def _report_failure(core: LinkCore, reason: LinkError) -> None:
    """Entering ``down`` after a failed attempt (its data is built: ``core.failures`` counts it)."""
    core.phase = "down"
    core.effects.attempt_failed(reason, core.retry_in_s)
    core.settle(reason)


# --------------------------------------------------------------------------------------------
# handshaking


@_handshaking_state.upon(LinkInputs.acknowledged).to(_open_state)
def _acknowledged(inputs: LinkInputs, core: LinkCore, data: Deadline) -> None:
    data.stop()
    _now_open(core)


@_handshaking_state.upon(LinkInputs.acknowledged_with_sessions).to(_reconciling_state)
def _start_reconcile(inputs: LinkInputs, core: LinkCore, data: Deadline) -> None:
    data.stop()
    core.phase = "reconciling"
    core.effects.begin_reconcile()


def _handshake_fails(inputs: LinkInputs, core: LinkCore, data: Deadline, reason: LinkError) -> None:
    data.stop()
    core.effects.abort()
    _report_failure(core, reason)


_handshaking_state.upon(LinkInputs.handshake_failed).to(_down_state)(_handshake_fails)
_handshaking_state.upon(LinkInputs._timed_out).to(_down_state)(_handshake_fails)
_handshaking_state.upon(LinkInputs.connection_lost).to(_down_state)(_handshake_fails)


@_handshaking_state.upon(LinkInputs.connection_ended).to(_closed)
def _ended_in_handshake(
    inputs: LinkInputs, core: LinkCore, data: Deadline, reason: LinkError
) -> None:
    data.stop()
    core.last_reason = reason
    core.settle(reason)
    _enter_closed(core)


_handshaking_state.upon(LinkInputs.connection_made).loop()(_reject_stray)
_handshaking_state.upon(LinkInputs.close).to(_closed)(_close_timed)


_ignore(
    _handshaking_state,
    LinkInputs.start,
    LinkInputs.redial,
    LinkInputs.wait_open,
)
_ignore(
    _handshaking_state,
    LinkInputs.dial_failed,
    LinkInputs.reconcile_failed,
)


# --------------------------------------------------------------------------------------------
# reconciling


@_reconciling_state.upon(LinkInputs.reconciled).to(_open_state)
def _reconciled(inputs: LinkInputs, core: LinkCore, data: Deadline) -> None:
    data.stop()
    _now_open(core)


_reconciling_state.upon(LinkInputs.reconcile_failed).to(_down_state)(_handshake_fails)
_reconciling_state.upon(LinkInputs._timed_out).to(_down_state)(_handshake_fails)
_reconciling_state.upon(LinkInputs.connection_lost).to(_down_state)(_handshake_fails)


_reconciling_state.upon(LinkInputs.connection_made).loop()(_reject_stray)
_reconciling_state.upon(LinkInputs.close).to(_closed)(_close_timed)


_ignore(
    _reconciling_state,
    LinkInputs.start,
    LinkInputs.redial,
    LinkInputs.wait_open,
    LinkInputs.acknowledged,
    LinkInputs.acknowledged_with_sessions,
    LinkInputs.dial_failed,
    LinkInputs.handshake_failed,
    LinkInputs.connection_ended,
)


def _now_open(core: LinkCore) -> None:
    reconnected = core.ever_open
    core.ever_open = True
    core.failures = 0
    core.last_reason = None
    core.phase = "open"
    core.effects.opened(reconnected)
    core.settle(None)


# --------------------------------------------------------------------------------------------
# open


@_open_state.upon(LinkInputs.connection_lost).to(_connecting_state)
def _redial_at_once(inputs: LinkInputs, core: LinkCore, data: Open, reason: LinkError) -> None:
    data.stop()
    core.last_reason = reason
    core.phase = "connecting"
    core.effects.dropped(reason)


@_open_state.upon(LinkInputs.connection_ended).to(_closed)
def _ended(inputs: LinkInputs, core: LinkCore, data: Open, reason: LinkError) -> None:
    data.stop()
    core.last_reason = reason
    core.phase = "closed"
    core.effects.dropped(reason)
    _enter_closed(core)


@_open_state.upon(LinkInputs.redial).to(_connecting_state)
def _replace(inputs: LinkInputs, core: LinkCore, data: Open) -> None:
    data.stop()
    core.phase = "connecting"
    core.effects.replaced()


@_open_state.upon(LinkInputs._keepalive_due).loop()
def _keepalive(inputs: LinkInputs, core: LinkCore, data: Open) -> None:
    core.effects.send_keepalive()
    data.keepalive = core.clock.callLater(core.keepalive_interval_s, inputs._keepalive_due)


@_open_state.upon(LinkInputs._deadline_due).loop()
def _check_silence(inputs: LinkInputs, core: LinkCore, data: Open) -> None:
    quiet = core.clock.seconds() - core.last_heard
    if quiet >= core.silence_timeout_s:
        data.silence = None
        core.effects.silent(quiet)
    else:
        data.silence = core.clock.callLater(core.silence_timeout_s - quiet, inputs._deadline_due)


@_open_state.upon(LinkInputs.wait_open).loop()
def _open_wait(inputs: LinkInputs, core: LinkCore, data: Open) -> None:
    core.settle(None)


_open_state.upon(LinkInputs.connection_made).loop()(_reject_stray)


@_open_state.upon(LinkInputs.close).to(_closed)
def _close_open(inputs: LinkInputs, core: LinkCore, data: Open) -> None:
    data.stop()
    core.settle(_closed_error())
    _enter_closed(core, was_open=True)


_ignore(
    _open_state,
    LinkInputs.start,
    LinkInputs.acknowledged,
    LinkInputs.acknowledged_with_sessions,
    LinkInputs.reconciled,
    LinkInputs.dial_failed,
    LinkInputs.handshake_failed,
    LinkInputs.reconcile_failed,
)


# --------------------------------------------------------------------------------------------
# down


@_down_state.upon(LinkInputs._retry_due).to(_connecting_state)
def _retry(inputs: LinkInputs, core: LinkCore, data: Waiting) -> None:
    pass


@_down_state.upon(LinkInputs.redial).to(_connecting_state)
def _redial_now(inputs: LinkInputs, core: LinkCore, data: Waiting) -> None:
    data.stop()


_down_state.upon(LinkInputs.start).to(_connecting_state)(_redial_now)


@_down_state.upon(LinkInputs.wait_open).loop()
def _down_wait(inputs: LinkInputs, core: LinkCore, data: Waiting) -> None:
    core.settle(core.last_reason or LinkLostError("the link is down"))


_down_state.upon(LinkInputs.connection_made).loop()(_reject_stray)
_down_state.upon(LinkInputs.close).to(_closed)(_close_timed)


_ignore(
    _down_state,
    LinkInputs.dial_failed,
    LinkInputs.handshake_failed,
    LinkInputs.reconcile_failed,
    LinkInputs.connection_lost,
    LinkInputs.connection_ended,
)


# --------------------------------------------------------------------------------------------
# closed


@_closed.upon(LinkInputs.connection_made).loop()
def _closed_stray(inputs: LinkInputs, core: LinkCore) -> None:
    core.effects.reject()


@_closed.upon(LinkInputs.wait_open).loop()
def _closed_wait(inputs: LinkInputs, core: LinkCore) -> None:
    core.settle(_closed_error())


_ignore(
    _closed,
    LinkInputs.start,
    LinkInputs.redial,
    LinkInputs.close,
    LinkInputs.dial_failed,
    LinkInputs.handshake_failed,
    LinkInputs.acknowledged,
    LinkInputs.acknowledged_with_sessions,
    LinkInputs.reconciled,
    LinkInputs.reconcile_failed,
    LinkInputs.connection_lost,
    LinkInputs.connection_ended,
    LinkInputs._timed_out,
    LinkInputs._retry_due,
    LinkInputs._keepalive_due,
    LinkInputs._deadline_due,
)

LinkMachine = _link.build()
