"""The head's link machine (sfnode.head.link.machine) alone: a recording fake for its effects and a
``Clock``, asserted as sequences of what the machine asked for.

These pin the redial schedule (at once after a drop, then backoff from about 0.1 s to a cap),
the deadlines of each step, the keepalive and the silence that marks a hung node, and what each
state does with the inputs it does not expect.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from sfnode.head.link.machine import (
    ConnectError,
    LinkCore,
    LinkError,
    LinkInputs,
    LinkLostError,
    LinkMachine,
    ReconcileError,
    retry_policy,
)


class Recorder:
    """LinkEffects that log every call as a short string."""

    def __init__(self, dialable: bool = True) -> None:
        self.calls: list[str] = []
        self.attempts: list[Deferred[Any]] = []
        self.dialable = dialable
        self.machine: LinkInputs | None = None

    def dial(self) -> Deferred[Any] | None:
        self.calls.append("dial")
        if not self.dialable:
            return None
        attempt: Deferred[Any] = Deferred()
        self.attempts.append(attempt)
        attempt.addErrback(lambda failure: self.calls.append(f"attempt {failure.type.__name__}"))
        return attempt

    def attach(self) -> None:
        self.calls.append("attach")

    def reject(self) -> None:
        self.calls.append("reject")

    def abort(self) -> None:
        self.calls.append("abort")

    def begin_reconcile(self) -> None:
        self.calls.append("reconcile")

    def opened(self, reconnected: bool) -> None:
        self.calls.append(f"opened reconnected={reconnected}")

    def attempt_failed(self, reason: LinkError, retry_in_s: float) -> None:
        self.calls.append(f"failed {type(reason).__name__} retry {retry_in_s:g}")

    def dropped(self, reason: LinkError) -> None:
        self.calls.append(f"dropped {reason}")

    def replaced(self) -> None:
        self.calls.append("replaced")

    def silent(self, seconds: float) -> None:
        self.calls.append(f"silent {seconds:g}")
        assert self.machine is not None
        self.machine.connection_lost(LinkLostError("silent"))

    def send_keepalive(self) -> None:
        self.calls.append("keepalive")

    def closed(self) -> None:
        self.calls.append("closed")


def fixed_retry(failures: int) -> float:
    """1 s, 2 s, 4 s, ... capped at 8 s: easy to read in assertions."""
    return float(min(2 ** (failures - 1), 8))


@dataclass
class Harness:
    """A machine with its recording effects, its clock and its core."""

    machine: LinkInputs
    effects: Recorder
    clock: Clock
    core: LinkCore

    def waiter(self) -> Deferred[None]:
        """A waiter for the link to be open, settled by the machine."""
        d: Deferred[None] = Deferred()
        self.core.open_waiters.append(d)
        self.machine.wait_open()
        return d


class MachineTestCase(SynchronousTestCase):
    def machine(self, **core: Any) -> Harness:
        clock = Clock()
        effects = Recorder(dialable=core.pop("dialable", True))
        settings: dict[str, Any] = {
            "retry": fixed_retry,
            "handshake_timeout_s": 5.0,
            "keepalive_interval_s": 15.0,
            "silence_timeout_s": 10.0,
        }
        settings.update(core)
        link_core = LinkCore(effects=effects, clock=clock, **settings)
        machine = LinkMachine(link_core)
        effects.machine = machine
        return Harness(machine, effects, clock, link_core)

    def open(self, **core: Any) -> Harness:
        h = self.machine(**core)
        h.machine.start()
        h.machine.connection_made()
        h.machine.acknowledged()
        h.effects.calls.clear()
        return h


class ConnectTests(MachineTestCase):
    def test_a_first_connection_dials_says_hello_and_opens(self) -> None:
        """start dials; the connection is attached (HELLO) and the ack opens the link; a
        waiter registered meanwhile fires then."""
        h = self.machine()
        h.machine.start()
        opened = h.waiter()
        self.assertNoResult(opened)
        h.machine.connection_made()
        h.machine.acknowledged()
        self.assertEqual(h.effects.calls, ["dial", "attach", "opened reconnected=False"])
        self.successResultOf(opened)
        self.assertEqual(sorted(c.getTime() for c in h.clock.getDelayedCalls()), [10.0, 15.0])

    def test_failed_attempts_back_off_and_the_delay_resets_once_open(self) -> None:
        """Each failed attempt waits longer (1, 2, 4, 8, 8 s here); after an open link drops,
        the redial is at once and a failure waits the first delay again."""
        h = self.machine()
        h.machine.start()
        for delay in (1, 2, 4, 8, 8):
            h.machine.dial_failed(ConnectError("could not connect: connection refused"))
            self.assertEqual(h.effects.calls[-1], f"failed ConnectError retry {delay}")
            h.clock.advance(delay - 0.01)
            self.assertEqual(h.effects.calls[-1], f"failed ConnectError retry {delay}")
            h.clock.advance(0.01)
            self.assertEqual(h.effects.calls[-1], "dial")
        h.machine.connection_made()
        h.machine.acknowledged()
        h.effects.calls.clear()
        h.machine.connection_lost(LinkLostError("reset"))
        self.assertEqual(h.effects.calls, ["dial", "dropped reset"])
        h.machine.dial_failed(ConnectError("refused"))
        self.assertEqual(h.effects.calls[-1], "failed ConnectError retry 1")

    def test_each_step_has_its_deadline(self) -> None:
        """Connecting, the handshake and the reconcile each fail after handshake_timeout_s
        with their own reason; a connect that timed out is cancelled and its late failure
        changes nothing."""
        h = self.machine()
        h.machine.start()
        h.clock.advance(5)
        self.assertEqual(
            h.effects.calls, ["dial", "attempt CancelledError", "failed ConnectError retry 1"]
        )
        h.clock.advance(1)
        h.machine.connection_made()
        h.clock.advance(5)
        self.assertEqual(h.effects.calls[-2:], ["abort", "failed HandshakeTimeoutError retry 2"])
        h.clock.advance(2)
        h.machine.connection_made()
        h.machine.acknowledged_with_sessions()
        waiter = h.waiter()
        h.clock.advance(5)
        self.assertEqual(
            h.effects.calls[-3:], ["reconcile", "abort", "failed ReconcileError retry 4"]
        )
        self.failureResultOf(waiter, ReconcileError)

    def test_a_reconcile_opens_the_link_as_reconnected(self) -> None:
        """After a drop the new connection reconciles first; reconciled opens the link, as a
        reconnect, and fires the waiters."""
        h = self.open()
        h.machine.connection_lost(LinkLostError("reset"))
        waiter = h.waiter()
        h.machine.connection_made()
        h.machine.acknowledged_with_sessions()
        self.assertNoResult(waiter)
        h.machine.reconciled()
        self.successResultOf(waiter)
        self.assertEqual(
            h.effects.calls,
            ["dial", "dropped reset", "attach", "reconcile", "opened reconnected=True"],
        )

    def test_a_waiter_on_a_down_link_fails_at_once_with_the_reason(self) -> None:
        """wait_open while down fails with the reason of the last failure; while an attempt
        runs it waits for its outcome."""
        h = self.machine()
        h.machine.start()
        waiting = h.waiter()
        h.machine.dial_failed(ConnectError("could not connect: connection refused"))
        self.assertIn("refused", str(self.failureResultOf(waiting, ConnectError).value))
        again = h.waiter()
        self.assertIn("refused", str(self.failureResultOf(again, ConnectError).value))

    def test_redial_on_an_open_link_replaces_its_connection(self) -> None:
        """redial (a forced reconnect) drops the open connection and dials a new one."""
        h = self.open()
        h.machine.redial()
        self.assertEqual(h.effects.calls, ["dial", "replaced"])


class OpenTests(MachineTestCase):
    def test_keepalive_every_interval(self) -> None:
        """An open link sends a KEEPALIVE every keepalive_interval_s."""
        h = self.open(silence_timeout_s=0)
        h.clock.advance(14.9)
        self.assertEqual(h.effects.calls, [])
        h.clock.advance(0.1)
        self.assertEqual(h.effects.calls, ["keepalive"])
        h.clock.advance(15)
        self.assertEqual(h.effects.calls, ["keepalive", "keepalive"])

    def test_a_node_silent_for_the_window_is_dropped_and_redialled(self) -> None:
        """Nothing heard for silence_timeout_s: the link reports the silence (the owner aborts
        it) and redials; anything heard pushes the deadline back."""
        h = self.open(keepalive_interval_s=100)
        h.clock.advance(6)
        h.core.last_heard = h.clock.seconds()
        h.clock.advance(9.9)
        self.assertEqual(h.effects.calls, [])
        h.clock.advance(0.1)
        self.assertEqual(h.effects.calls, ["silent 10", "dial", "dropped silent"])

    def test_close_stops_every_timer(self) -> None:
        """close from any state leaves no timer behind and fails the waiters."""
        for prepare in ("new", "connecting", "handshaking", "open", "down"):
            h = self.machine()
            if prepare != "new":
                h.machine.start()
            if prepare in ("handshaking", "open"):
                h.machine.connection_made()
            if prepare == "open":
                h.machine.acknowledged()
            if prepare == "down":
                h.machine.dial_failed(ConnectError("refused"))
            waiter: Deferred[None] | None = None
            if prepare in ("connecting", "handshaking"):
                waiter = h.waiter()
            h.machine.close()
            self.assertEqual(h.effects.calls[-1], "closed", prepare)
            self.assertEqual(h.clock.getDelayedCalls(), [], prepare)
            if waiter is not None:
                self.failureResultOf(waiter, LinkLostError)
            h.machine.start()
            h.machine.connection_made()
            self.assertEqual(h.effects.calls[-2:], ["closed", "reject"], prepare)


class AcceptedTests(MachineTestCase):
    def test_a_node_that_dialed_in_ends_with_its_connection(self) -> None:
        """A link that cannot dial (the node dialed in) goes from its connection straight to
        closed when the connection ends; it never redials."""
        h = self.machine(dialable=False)
        h.machine.start()
        h.machine.connection_made()
        h.machine.acknowledged()
        h.machine.connection_ended(LinkLostError("bye"))
        self.assertEqual(
            h.effects.calls, ["dial", "attach", "opened reconnected=False", "dropped bye", "closed"]
        )
        self.assertEqual(h.clock.getDelayedCalls(), [])

    def test_stray_connections_are_rejected(self) -> None:
        """A second connection for a link that has one is aborted, whatever the state."""
        h = self.open()
        h.machine.connection_made()
        self.assertEqual(h.effects.calls, ["reject"])


class RetryPolicyTests(SynchronousTestCase):
    def test_backoff_from_a_tenth_of_a_second_to_the_cap_with_jitter(self) -> None:
        """The policy doubles from 0.1 s up to the cap; jitter shortens a delay by up to a
        fifth, never lengthens it."""
        exact = retry_policy(10.0, jitter=lambda: 0.0)
        self.assertEqual(
            [round(exact(n), 3) for n in range(1, 10)],
            [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 10.0, 10.0],
        )
        shortest = retry_policy(10.0, jitter=lambda: 0.999999)
        self.assertAlmostEqual(shortest(1), 0.08, places=5)
        self.assertAlmostEqual(shortest(50), 8.0, places=4)
