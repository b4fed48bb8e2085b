"""``twistd sfnode``: the command line of the node agent, and the service another program embeds.

:class:`Options` parses and checks the command line without touching the network, a model or
torch; :func:`makeService` turns checked options into a plain ``MultiService`` (engine, node
agent, and either a listening port or a reconnecting dial to a head) that ``twistd`` runs or that
any Twisted program can add to its own service tree.  :func:`node_factory` builds the protocol
factory of a node (behind Noise when it has a fleet token), for listening or dialing.

This module must never import torch or transformers at import time, nor while parsing options:
``twistd --help`` and ``twistd sfnode --help`` have to stay fast.  Only :func:`build_engine`
imports them, and only for ``--engine transformers``.
"""

from __future__ import annotations

import os
import random
import re
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from twisted.application import service
from twisted.application.internet import ClientService
from twisted.internet import defer
from twisted.internet.interfaces import IProtocolFactory, IStreamClientEndpoint
from twisted.logger import Logger
from twisted.python import usage
from twisted.python.failure import Failure

from sfnode.admission import plaintext_refusal
from sfnode.config import (
    DEFAULT_DRAIN_TIMEOUT_MS,
    DEFAULT_HANDSHAKE_TIMEOUT_MS,
    DEFAULT_IDLE_TIMEOUT_MS,
    DEFAULT_MAX_GENERATIONS,
    DEFAULT_MAX_HANDSHAKES,
    DEFAULT_MAX_HELD_TOKENS,
    DEFAULT_MAX_LANES,
    DEFAULT_MAX_SESSIONS,
    DEFAULT_MAX_UNACKED_EVENTS,
    NodeConfig,
)
from sfnode.engines import WEIGHT_MODES
from sfnode.engines.pace import DEFAULT_STEP_MS
from sfnode.service import (
    DEFAULT_MODEL_NAME,
    ListeningService,
    StartupError,
    add_child,
    client_from_string,
    default_model_name,
    describe_failure,
    exit_zero_after_a_clean_stop,
    progress_bars_only_on_a_terminal,
    server_from_string,
)
from sfnode.tokens import default_token_path, read_token

if TYPE_CHECKING:
    from sfnode.generation import Engine
    from sfnode.node import NodeAgent

log = Logger(namespace="sfnode.tap")

ENGINES = ("transformers", "mock")
DTYPES = ("auto", "float32", "bfloat16", "float16")
MOCK_CONTEXT_WINDOW = 4096
"""The mock engine's context window when ``--max-context`` is 0."""
# D9: a node that dials its head redials 0.1 s after a lost connection or a failed attempt,
# doubling up to 2 s, so that it is back within about 2 s of its head listening again.
RECONNECT_INITIAL_S = 0.1
RECONNECT_FACTOR = 2.0
RECONNECT_MAX_S = 2.0
REDIAL_LOG_EVERY = 30
"""While the head stays unreachable, one redial line per this many attempts (about a minute)."""
U32_MAX = 0xFFFF_FFFF
EXIT_REFUSED = 1
"""Exit status of a ``--head`` node whose head holds another fleet token (D9)."""

_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
_TRANSFORMERS_ONLY = (
    "model",
    "dtype",
    "device",
    "threads",
    "cache-dir",
    "kv-blocks",
    "weights",
    "prefix-cache-blocks",
    "prefill-chunk",
    "step-tokens",
    "step-ms",
    "interactive-lanes",
)

_MOCK_ONLY = ("token-delay-ms",)


class NodeStartupError(StartupError):
    """The node cannot start (model not loadable, port taken).

    A ``SystemExit`` so that ``twistd`` prints the message alone and exits non-zero; an
    embedding program can catch it by this name.
    """


class _PlaceholderReactor:
    """Stands in for the reactor while endpoint strings are syntax-checked.

    Endpoint constructors only store their reactor; the real one is used in ``makeService``.
    Importing ``twisted.internet.reactor`` during option parsing would install the default
    reactor before ``twistd --reactor`` can choose one.
    """


def _check_server_endpoint(description: str) -> None:
    try:
        server_from_string(_PlaceholderReactor(), description)
    except Exception as e:
        raise usage.UsageError(
            f"--listen {description!r} is not a server endpoint string: {e} "
            "(for example tcp:8454:interface=127.0.0.1 or unix:/run/sfnode.sock)"
        ) from e


def _check_client_endpoint(description: str) -> None:
    try:
        client_from_string(_PlaceholderReactor(), description)
    except NameError as e:
        # Twisted's tls: parser names optionsForClientTLS, which exists only with pyOpenSSL.
        raise usage.UsageError(
            f"--head {description!r} needs TLS support: pip install 'twisted[tls]' ({e})"
        ) from e
    except Exception as e:
        raise usage.UsageError(
            f"--head {description!r} is not a client endpoint string: {e} "
            "(for example tcp:head.example:8454 or unix:/run/sfhead.sock)"
        ) from e


def _non_negative(name: str, value: object, minimum: int = 0, maximum: int | None = None) -> int:
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


class Options(usage.Options):
    """``twistd sfnode`` options; after ``parseOptions`` every value is checked and typed.

    Integers are ints, ``auth-token`` holds the trimmed token bytes (b"" without a token),
    ``identity`` and ``model-name`` hold their resolved defaults.
    """

    synopsis = "(--listen ENDPOINT | --head ENDPOINT) [options]"
    longdesc = (
        "Runs a Link F node agent. It either accepts heads on --listen or dials one head given by "
        "--head (redialling 0.1 s after losing it, then doubling up to 2 s apart). ENDPOINT is "
        "a Twisted endpoint "
        "string such as tcp:8454:interface=127.0.0.1 (listen) or tcp:head.example:8454 (dial). "
        "Without a fleet token (--auth-file) only loopback addresses are allowed, unless "
        "--insecure-no-auth is given."
    )

    optFlags: ClassVar[list[list[str | None]]] = [
        [
            "insecure-no-auth",
            None,
            "Allow a non-loopback --listen or --head without a fleet token (plaintext link, "
            "any head accepted).",
        ],
        [
            "stock-kernels",
            None,
            "transformers: run the model's own forward on stock PyTorch kernels (slower; by "
            "default Llama models run through sfnode's own step, see --weights).",
        ],
        [
            "no-prefix-cache",
            None,
            "transformers: do not reuse the KV blocks of earlier prompts (by default a prompt "
            "that starts like an earlier one computes only the rest).",
        ],
    ]

    optParameters: ClassVar[list[list[Any]]] = [
        ["head", None, None, "Dial the head at this client endpoint and keep reconnecting."],
        ["listen", None, None, "Accept heads on this server endpoint (tcp:0 picks a free port)."],
        ["engine", None, "transformers", f"Generation engine: {' or '.join(ENGINES)}."],
        [
            "model",
            None,
            None,
            "transformers: model folder or .gguf file (default: the bundled "
            f"{DEFAULT_MODEL_NAME}).",
        ],
        [
            "model-name",
            None,
            None,
            "Model name offered to heads (default: 'mock' for the mock engine, else the model "
            f"folder name or file stem, else {DEFAULT_MODEL_NAME}).",
        ],
        ["identity", None, None, "Node identity in HELLO_ACK_F (default: this host's name)."],
        ["max-lanes", None, str(DEFAULT_MAX_LANES), "Generations decoded at once (at least 1)."],
        [
            "max-context",
            None,
            "0",
            "Context window in tokens: the mock engine's window (0: 4096); caps the transformers "
            "model's own window (0: no cap).",
        ],
        [
            "auth-file",
            None,
            None,
            "File holding the fleet token (trimmed of whitespace; an empty file means no token). "
            "Default: $SFNODE_HOME/token or ~/.config/sfnode/token when that file exists. "
            "Create one with: python -m sfnode token.",
        ],
        [
            "handshake-timeout-ms",
            None,
            str(DEFAULT_HANDSHAKE_TIMEOUT_MS),
            "Close a connection that sends no HELLO within this time (0: wait forever).",
        ],
        [
            "idle-timeout-ms",
            None,
            str(DEFAULT_IDLE_TIMEOUT_MS),
            "Close a connection that sends no frame for this long (0: never).",
        ],
        [
            "drain-timeout",
            None,
            str(DEFAULT_DRAIN_TIMEOUT_MS // 1000),
            "On SIGTERM: seconds running generations may take to finish before they are "
            "cancelled (new ones are declined at once).",
        ],
        [
            "max-handshakes",
            None,
            str(DEFAULT_MAX_HANDSHAKES),
            "Connections in their handshake at once; more are closed at once (0: no limit).",
        ],
        [
            "max-sessions",
            None,
            str(DEFAULT_MAX_SESSIONS),
            "Sessions held at once; an ASSIGN beyond it is refused and that session's "
            "generations get FINISH_REFUSED (0: no limit).",
        ],
        [
            "max-unacked-events",
            None,
            str(DEFAULT_MAX_UNACKED_EVENTS),
            "Unacknowledged events per generation; past it the generation stops and its "
            "session is fenced (0: no limit).",
        ],
        [
            "max-held-tokens",
            None,
            str(DEFAULT_MAX_HELD_TOKENS),
            "Tokens a generation holds while its head does not read; past it the generation "
            "stops (0: no limit).",
        ],
        [
            "max-generations",
            None,
            str(DEFAULT_MAX_GENERATIONS),
            "Generations running or queued at once; more are declined (0: no limit).",
        ],
        [
            "metrics",
            None,
            None,
            "Serve this node's engine figures in Prometheus format at /metrics on this server "
            "endpoint (default: none).",
        ],
        ["token-delay-ms", None, None, "mock only: delay between tokens (default 0)."],
        ["dtype", None, None, f"transformers: weight dtype, one of {'|'.join(DTYPES)} (auto)."],
        ["device", None, None, "transformers: auto|cpu|cuda|cuda:N (default auto)."],
        ["threads", None, None, "transformers: torch CPU threads (default 0: torch's choice)."],
        [
            "cache-dir",
            None,
            None,
            "transformers: where converted GGUF models are kept (default ~/.cache/sfnode/models).",
        ],
        [
            "kv-blocks",
            None,
            None,
            "transformers: KV cache blocks of 16 tokens (default 0: the engine sizes it).",
        ],
        [
            "weights",
            None,
            None,
            "transformers: how the weights are held and multiplied, one of "
            f"{'|'.join(WEIGHT_MODES)} (default auto: a GGUF file's 4-bit matrices as int4 and "
            "its 8-bit ones as int8 or bfloat16, whichever multiplies faster here; float weights "
            "as they are).  float32 is the exact path; bfloat16, int8 and int4 compute in "
            "bfloat16.",
        ],
        [
            "prefix-cache-blocks",
            None,
            None,
            "transformers: blocks of 16 tokens the prefix cache keeps (default 0: as many as "
            "--kv-blocks).",
        ],
        [
            "prefill-chunk",
            None,
            None,
            "transformers: a prompt is computed in chunks of this many tokens (default 256).",
        ],
        [
            "step-tokens",
            None,
            None,
            "transformers: prompt tokens computed per step beside the decoding lanes (default "
            "512).",
        ],
        [
            "step-ms",
            None,
            None,
            "transformers: while interactive work may need the node (an interactive request "
            "waiting or running, or a lane free for one), batch prompt tokens ride in a step "
            "only as far as it is predicted, from the step times measured on this machine, to "
            "take at most this many milliseconds, so a chat's first token comes within a short "
            f"step on a slow CPU too (default {DEFAULT_STEP_MS}; 0: only --step-tokens bounds "
            "a step).",
        ],
        [
            "interactive-lanes",
            None,
            None,
            "transformers: lanes kept for interactive requests, which batch requests never hold "
            "(default 1; batch work always keeps at least one lane).",
        ],
    ]

    def postOptions(self) -> None:
        """Check every value and replace it by its typed, defaulted form."""
        head, listen = self["head"], self["listen"]
        if (head is None) == (listen is None):
            raise usage.UsageError("give exactly one of --head ENDPOINT or --listen ENDPOINT")
        if self["metrics"] is not None:
            _check_server_endpoint(self["metrics"])
        if listen is not None:
            _check_server_endpoint(listen)
        else:
            _check_client_endpoint(head)

        engine = self["engine"]
        if engine not in ENGINES:
            raise usage.UsageError(f"--engine must be one of {', '.join(ENGINES)}, not {engine!r}")
        wrong = _TRANSFORMERS_ONLY if engine == "mock" else _MOCK_ONLY
        given = [f"--{name}" for name in wrong if self[name] is not None]
        if engine == "mock":
            given += [f"--{flag}" for flag in ("stock-kernels", "no-prefix-cache") if self[flag]]
        if given:
            raise usage.UsageError(f"{', '.join(given)} cannot be used with --engine {engine}")

        self["max-lanes"] = _non_negative("max-lanes", self["max-lanes"], 1, U32_MAX)
        for name in (
            "max-context",
            "handshake-timeout-ms",
            "idle-timeout-ms",
            "drain-timeout",
            "max-handshakes",
            "max-sessions",
            "max-unacked-events",
            "max-held-tokens",
            "max-generations",
        ):
            self[name] = _non_negative(name, self[name])
        for name, default in (
            ("token-delay-ms", 0),
            ("step-ms", DEFAULT_STEP_MS),
            ("threads", 0),
            ("kv-blocks", 0),
            ("prefix-cache-blocks", 0),
            ("interactive-lanes", 1),
        ):
            self[name] = default if self[name] is None else _non_negative(name, self[name])
        for name, default in (("prefill-chunk", 256), ("step-tokens", 512)):
            value = default if self[name] is None else self[name]
            self[name] = _non_negative(name, value, 1, U32_MAX)
        self["weights"] = "auto" if self["weights"] is None else self["weights"]
        if self["weights"] not in WEIGHT_MODES:
            raise usage.UsageError(
                f"--weights must be one of {', '.join(WEIGHT_MODES)}, not {self['weights']!r}"
            )
        if self["stock-kernels"] and self["weights"] not in ("auto", "float32"):
            raise usage.UsageError(
                f"--weights {self['weights']} needs sfnode's own step; --stock-kernels runs the "
                "model's forward on its float weights"
            )

        self["dtype"] = "auto" if self["dtype"] is None else self["dtype"]
        if self["dtype"] not in DTYPES:
            raise usage.UsageError(
                f"--dtype must be one of {', '.join(DTYPES)}, not {self['dtype']!r}"
            )
        self["device"] = "auto" if self["device"] is None else self["device"]
        if not _DEVICE.fullmatch(self["device"]):
            raise usage.UsageError(
                f"--device must be auto, cpu, cuda or cuda:N, not {self['device']!r}"
            )
        if self["model"] is not None and not Path(self["model"]).expanduser().exists():
            raise usage.UsageError(f"--model {self['model']} does not exist")

        self["auth-token"] = b""
        auth_file = self["auth-file"]
        if auth_file is None and default_token_path().is_file():
            auth_file = str(default_token_path())
        if auth_file is not None:
            try:
                self["auth-token"] = read_token(auth_file)
            except OSError as e:
                raise usage.UsageError(
                    f"cannot read --auth-file {auth_file}: {e.strerror or e}"
                ) from e
        # docs/protocol.md section 5.3: checked here, before makeService loads any model.
        refusal = plaintext_refusal(
            token=self["auth-token"], insecure=self["insecure-no-auth"], listen=listen, dial=head
        )
        if refusal is not None:
            raise usage.UsageError(refusal)

        if self["identity"] is None:
            self["identity"] = socket.gethostname()
        if not self["identity"]:
            raise usage.UsageError("--identity must not be empty")
        if self["model-name"] is None:
            # The mock engine is offered as "mock"; a model as its folder name or file stem.
            self["model-name"] = "mock" if engine == "mock" else default_model_name(self["model"])
        if not self["model-name"]:
            raise usage.UsageError("--model-name must not be empty")


def node_config(options: Options) -> NodeConfig:
    """The :class:`NodeConfig` that checked ``options`` describe."""
    return NodeConfig(
        model_name=options["model-name"],
        identity=options["identity"],
        max_lanes=options["max-lanes"],
        auth_token=options["auth-token"],
        handshake_timeout_ms=options["handshake-timeout-ms"],
        idle_timeout_ms=options["idle-timeout-ms"],
        max_handshakes=options["max-handshakes"],
        max_sessions=options["max-sessions"],
        max_unacked_events=options["max-unacked-events"],
        max_held_tokens=options["max-held-tokens"],
        max_generations=options["max-generations"],
        drain_timeout_ms=options["drain-timeout"] * 1000,
    )


def build_engine(reactor: Any, options: Options) -> Engine:
    """The engine that ``options`` choose: the one place where an engine is constructed.

    :raises NodeStartupError: the transformers engine or its model cannot be loaded.
    """
    if options["engine"] == "mock":
        from sfnode.generation import MockEngine

        return MockEngine(
            reactor,
            context_window=options["max-context"] or MOCK_CONTEXT_WINDOW,
            max_lanes=options["max-lanes"],
            token_delay_s=options["token-delay-ms"] / 1000.0,
        )
    try:
        from sfnode import models
        from sfnode.engines.transformers_engine import TransformersEngine
    except ImportError as e:
        raise NodeStartupError(f"sfnode: the transformers engine is not available: {e}") from e
    try:
        loaded = models.load_model(
            options["model"],
            dtype=options["dtype"],
            device=options["device"],
            threads=options["threads"] or None,
            cache_dir=options["cache-dir"],
        )
    except models.ModelLoadError as e:
        raise NodeStartupError(f"sfnode: {e}") from e
    from sfnode.engines.llama_weights import WeightsError

    try:
        return TransformersEngine.from_loaded(
            loaded,
            reactor,
            release_float_weights=True,
            max_lanes=options["max-lanes"],
            kv_blocks=options["kv-blocks"] or None,
            context_window=options["max-context"] or None,
            weights=options["weights"],
            prefix_cache=not options["no-prefix-cache"],
            prefix_cache_blocks=options["prefix-cache-blocks"] or None,
            prefill_chunk=options["prefill-chunk"],
            step_tokens=options["step-tokens"],
            step_ms=float(options["step-ms"]),
            interactive_lanes=options["interactive-lanes"],
            onednn=not options["stock-kernels"],
            lean_step=not options["stock-kernels"],
        )
    except (ValueError, WeightsError) as e:
        raise NodeStartupError(f"sfnode: cannot start the transformers engine: {e}") from e


def head_retry_policy(
    jitter: Callable[[], float] = random.random,
    on_delay: Callable[[int, float], None] | None = None,
) -> Callable[[int], float]:
    """D9's redial delays for ``ClientService``: 0.1 s, 0.2 s, 0.4 s, ... up to 2 s, each
    shortened by up to a fifth at random (``jitter()`` in [0, 1)) so that a fleet of nodes does
    not redial in lockstep.

    ``ClientService`` counts failed attempts from 1 and starts again at 1 once a connection was
    made, so a node that loses its head redials 0.1 s later.  ``on_delay(attempt, delay)`` is
    told every delay (for the log).
    """

    def delay(attempt: int) -> float:
        steps = min(max(attempt, 1) - 1, 16)
        base = min(RECONNECT_INITIAL_S * RECONNECT_FACTOR**steps, RECONNECT_MAX_S)
        wait = base * (1.0 - 0.2 * jitter())
        if on_delay is not None:
            on_delay(attempt, wait)
        return wait

    return delay


class HeadDialer:
    """The ``--head`` endpoint, named by its endpoint string, remembering how the last attempt
    ended so that each redial is logged with the endpoint and the real reason."""

    def __init__(self, endpoint: IStreamClientEndpoint, description: str) -> None:
        self._endpoint = endpoint
        self.description = description
        self._outcome = ""
        self._logged = ""

    def connect(self, factory: IProtocolFactory) -> defer.Deferred[Any]:
        attempt = self._endpoint.connect(factory)

        def connected(protocol: Any) -> Any:
            self._outcome = "the connection to it ended"
            self._logged = ""
            return protocol

        def failed(failure: Failure) -> Failure:
            self._outcome = f"could not connect: {describe_failure(failure)}"
            return failure

        return attempt.addCallbacks(connected, failed)

    def redialling(self, attempt: int, delay: float) -> None:
        """Log a redial: the first after a connection or a new reason, then now and again."""
        if self._outcome == self._logged and attempt % REDIAL_LOG_EVERY:
            return
        self._logged = self._outcome
        log.info(
            "the head at {endpoint}: {outcome}; redialling in {delay:.1f} s (attempt {attempt})",
            endpoint=self.description,
            outcome=self._outcome,
            delay=delay,
            attempt=attempt,
        )

    def __repr__(self) -> str:
        return self.description


def _discard(event: object) -> None:
    """A log observer that drops what it is given."""


class AgentService(service.Service):
    """Starts the node agent (and its engine) with the service tree and stops it with it.

    Stopping drains first (:meth:`NodeAgent.drain`: decline new generations, finish or cancel
    the running ones, wait briefly for acks), then closes every connection.
    """

    def __init__(self, agent: NodeAgent) -> None:
        self.agent = agent

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        self.agent.start()

    def stopService(self) -> defer.Deferred[None]:
        super().stopService()  # type: ignore[no-untyped-call]
        stopped = self.agent.drain()
        stopped.addCallback(lambda _: self.agent.stop())
        stopped.addCallback(lambda _: log.info("sfnode stopped"))
        return stopped


class HeadDialService(ClientService):
    """D9's redialling connection to the head; on stop it keeps the link until the drain ends.

    ``ClientService``'s own "Scheduling retry ... <endpoint object>" lines are dropped:
    :class:`HeadDialer` logs each redial with the endpoint string and the reason.
    """

    _log = Logger(namespace="sfnode.tap", observer=_discard)  # type: ignore[arg-type]

    def __init__(self, agent: NodeAgent, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.agent = agent

    def stopService(self) -> defer.Deferred[None]:
        drained = self.agent.drain()
        drained.addCallback(lambda _: ClientService.stopService(self))
        return drained


def exit_after_refusal(reactor: Any, message: str) -> None:
    """The default reaction of a ``--head`` node refused by its head: stop, exit status 1.

    ``twistd`` has no exit status of its own for a stopped reactor, so the process ends with
    ``os._exit(1)`` after the reactor's shutdown (services stopped, logs flushed).
    """

    def leave() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_REFUSED)

    print(message, file=sys.stderr, flush=True)
    reactor.addSystemEventTrigger("after", "shutdown", leave)
    reactor.stop()


def node_factory(
    agent: NodeAgent, on_refused: Callable[[str], None] | None = None
) -> IProtocolFactory:
    """The protocol factory of ``agent``, for listening or dialing; all its connections share
    the node.

    Each factory admits at most ``max_handshakes`` connections in their handshake at once
    (docs/protocol.md section 5.3).  With a fleet token the node is the Noise responder around
    it (D10), in both dial directions, and ``on_refused(peer)`` is called for a peer refused for
    holding another token.
    """
    from sfnode.noise import Role, secure_factory
    from sfnode.protocol import NodeFactory

    config = agent.config
    return secure_factory(
        NodeFactory(agent, config.max_handshakes),
        config.auth_token,
        role=Role.RESPONDER,
        clock=agent.clock,
        handshake_timeout_s=config.handshake_timeout_ms / 1000.0,
        on_refused=on_refused,
    )


def makeService(
    options: Options,
    reactor: Any = None,
    on_head_refused: Callable[[str], None] | None = None,
) -> service.MultiService:
    """The node as a service tree named ``sfnode``: ``agent``, then ``listen`` or ``head``.

    ``options`` must have been parsed (``Options().parseOptions([...])``).  ``reactor`` defaults
    to the global one.  The engine (and any model) is loaded here, before the services start.

    With ``--head``, a head that holds another fleet token stops the redialling and calls
    ``on_head_refused(message)``; the default (:func:`exit_after_refusal`) stops the reactor
    and ends the process with exit status 1.  An embedding program passes its own.

    :raises NodeStartupError: the engine cannot be built.
    """
    if reactor is None:
        from twisted.internet import reactor as global_reactor

        reactor = global_reactor
        exit_zero_after_a_clean_stop(reactor)
        progress_bars_only_on_a_terminal()
    from sfnode.node import NodeAgent

    engine = build_engine(reactor, options)
    agent = NodeAgent(reactor, engine, node_config(options))

    node = service.MultiService()  # type: ignore[no-untyped-call]
    node.setName("sfnode")  # type: ignore[no-untyped-call]
    add_child(node, "agent", AgentService(agent))
    if options["metrics"] is not None:
        from sfnode.metrics import metrics_site

        add_child(
            node,
            "metrics",
            ListeningService(
                server_from_string(reactor, options["metrics"]),
                metrics_site(agent),
                options["metrics"],
                what="metrics on",
                program="sfnode",
                error=NodeStartupError,
            ),
        )
    if options["listen"] is not None:
        description = options["listen"]
        add_child(
            node,
            "listen",
            ListeningService(
                server_from_string(reactor, description),
                node_factory(agent),
                description,
                what="listening on",
                program="sfnode",
                error=NodeStartupError,
            ),
        )
        return node
    description = options["head"]
    refused_reported = False

    def head_refused(peer: str) -> None:
        nonlocal refused_reported
        if refused_reported:
            return
        refused_reported = True
        message = (
            f"sfnode: the head at {description} ({peer}) refused this node's fleet token "
            "(its fleet token differs); stopping instead of redialling"
        )
        log.critical("{message}", message=message)
        dial.stopService()
        if on_head_refused is not None:
            on_head_refused(message)
        else:
            exit_after_refusal(reactor, message)

    dialer = HeadDialer(client_from_string(reactor, description), description)
    dial = HeadDialService(
        agent,
        dialer,
        node_factory(agent, on_refused=head_refused),
        head_retry_policy(on_delay=dialer.redialling),
        clock=reactor,
    )
    add_child(node, "head", dial)
    log.info("sfnode dialing the head at {endpoint}", endpoint=description)
    return node
