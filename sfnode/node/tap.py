"""``twistd sfnode``: the command line of the node agent, and the service another program embeds.

:class:`Options` parses and checks the command line without touching the network, a model or
torch; :func:`makeService` turns checked options into a plain ``MultiService`` (engine, node
agent, and either a listening port or a reconnecting dial to a head) that ``twistd`` runs or that
any Twisted program can add to its own service tree.  :func:`node_factory` builds the protocol
factory of a node (behind Noise when it has a fleet token), for listening or dialing.

This module must never import torch or transformers at import time, nor while parsing options:
``twistd --help`` and ``twistd sfnode --help`` have to stay fast.  Only :func:`build_engine`
imports them, and only for ``--engine transformers``.  zeroconf is imported only when
``makeService`` builds a ``--join auto`` node.
"""

from __future__ import annotations

import random
import re
import socket
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

from sfnode.discovery.rules import SERVICE_TYPE, HeadFinder, JoinTarget, parse_join, valid_head_name
from sfnode.engines import DEFAULT_DRAFT_TOKENS, KERNEL_MODES, SPECULATIVE_MODES, WEIGHT_MODES
from sfnode.engines.config import (
    DEFAULT_PREFILL_CHUNK,
    DEFAULT_STEP_MS,
    DEFAULT_STEP_TOKENS,
    EngineConfig,
)
from sfnode.linkf.backoff import RetryPolicy, retry_policy
from sfnode.linkf.fleet_token import default_token_path, read_token
from sfnode.linkf.handshake import is_loopback_listen, plaintext_refusal
from sfnode.linkf.model_cache import ModelRefused
from sfnode.node.config import (
    DEFAULT_DRAIN_TIMEOUT_MS,
    DEFAULT_FENCED_GRACE_MS,
    DEFAULT_HANDSHAKE_TIMEOUT_MS,
    DEFAULT_IDLE_TIMEOUT_MS,
    DEFAULT_MAX_ADDRESS_HANDSHAKES,
    DEFAULT_MAX_GENERATIONS,
    DEFAULT_MAX_HANDSHAKES,
    DEFAULT_MAX_HELD_TOKENS,
    DEFAULT_MAX_LANES,
    DEFAULT_MAX_SESSIONS,
    DEFAULT_MAX_UNACKED_EVENTS,
    STATUS_INTERVAL_MS,
    NodeConfig,
)
from sfnode.node.refused import RefusedEngine
from sfnode.runtime.service import (
    DEFAULT_MODEL_NAME,
    ListeningService,
    StartupError,
    add_child,
    check_endpoint,
    client_from_string,
    default_model_name,
    describe_failure,
    exit_zero_after_a_clean_stop,
    non_negative,
    progress_bars_only_on_a_terminal,
    server_from_string,
)

if TYPE_CHECKING:
    from sfnode.discovery.dnssd import Browser
    from sfnode.generation import Engine
    from sfnode.linkf.model_files import Bundle
    from sfnode.linkf.noise import NoiseProtocol
    from sfnode.node.agent import NodeAgent
    from sfnode.node.protocol import NodeProtocol

log = Logger(namespace="sfnode.node.tap")

ENGINES = ("transformers", "mock")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# D9: a node that dials its head redials 0.1 s after a lost connection or a failed attempt,
# doubling up to 2 s, so that it is back within about 2 s of its head listening again.
RECONNECT_INITIAL_S = 0.1
RECONNECT_FACTOR = 2.0
RECONNECT_MAX_S = 2.0
REDIAL_LOG_EVERY = 30
"""While the head stays unreachable, one redial line per this many attempts (about a minute)."""
U32_MAX = 0xFFFF_FFFF

_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
_TRANSFORMERS_ONLY = (
    "dtype",
    "device",
    "threads",
    "cache-dir",
    "kv-blocks",
    "weights",
    "kernels",
    "prefix-cache-blocks",
    "prefill-chunk",
    "step-tokens",
    "step-ms",
    "interactive-lanes",
    "speculative",
    "draft-tokens",
)

_MOCK_ONLY = ("token-delay-ms",)

_COUNTS = (
    "max-context",
    "handshake-timeout-ms",
    "idle-timeout-ms",
    "drain-timeout",
    "max-handshakes",
    "max-address-handshakes",
    "max-sessions",
    "fenced-grace-ms",
    "max-unacked-events",
    "max-held-tokens",
    "max-generations",
)
"""Options that are counts or durations with a default of their own (0 or more)."""
_COUNTS_WITH_DEFAULTS = (
    ("token-delay-ms", 0),
    ("step-ms", DEFAULT_STEP_MS),
    ("threads", 0),
    ("kv-blocks", 0),
    ("prefix-cache-blocks", 0),
    ("interactive-lanes", 1),
)
"""Counts given without a default on the command line (one engine's only), and theirs."""


class NodeStartupError(StartupError):
    """The node cannot start (model not loadable, port taken).

    A ``SystemExit`` so that ``twistd`` prints the message alone and exits non-zero; an
    embedding program can catch it by this name.
    """


class NodeModelRefused(NodeStartupError):
    """The node's model is one sfnode does not support (docs/engine.md section 5.4): the
    message names it.  :func:`makeService` starts such a node anyway when it has a head to tell
    (docs/protocol.md section 5.2, D25)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason
        """The refusal alone (without the program's name), as the head is told it."""


NODE_SERVER_EXAMPLE = "tcp:8454:interface=127.0.0.1 or unix:/run/sfnode.sock"
HEAD_CLIENT_EXAMPLE = "tcp:head.example:8454 or unix:/run/sfhead.sock"


class Options(usage.Options):
    """``twistd sfnode`` options; after ``parseOptions`` every value is checked and typed.

    Integers are ints, ``auth-token`` holds the trimmed token bytes (b"" without a token),
    ``identity`` and ``model-name`` hold their resolved defaults.
    """

    synopsis = "(--join HOST[:PORT] | --join auto | --head ENDPOINT | --listen ENDPOINT) [options]"
    longdesc = (
        "Runs a Link F node agent. It either joins a head (--join HOST[:PORT] dials that head's "
        f"fleet listener; --join auto finds the head by DNS-SD ({SERVICE_TYPE}) on the local "
        "network and browses again whenever it stays unreachable), dials one head given as an "
        "endpoint (--head), or accepts heads on --listen. A node that dials keeps dialing: 0.1 s "
        "after losing its head, and after an attempt that failed (no answer, a failed handshake, "
        "another fleet token: each logged with its reason) twice as long as the last, up to 2 s. "
        "ENDPOINT is a Twisted endpoint string such as tcp:8454:interface=127.0.0.1 (listen) or "
        "tcp:head.example:8455 (dial). Without a fleet token (--auth-file) only loopback "
        "addresses are allowed, unless --insecure-no-auth is given."
    )

    optFlags: ClassVar[list[list[str | None]]] = [
        [
            "insecure-no-auth",
            None,
            "Allow a non-loopback --listen, --head or --join without a fleet token (plaintext "
            "link, any head accepted).",
        ],
        [
            "stock-kernels",
            None,
            "transformers: run the model's own forward on stock PyTorch kernels (slower; by "
            "default Llama models run through sfnode's own step, see --weights).",
        ],
        [
            "eager-step",
            None,
            "transformers: run each layer as separate torch operators, never through the "
            "native step (for comparison; docs/engine.md section 5.2).",
        ],
        [
            "metrics-insecure",
            None,
            "Allow --metrics on an address off loopback (anyone who reaches it reads what this "
            "node serves and how busy it is).",
        ],
        [
            "no-prefix-cache",
            None,
            "transformers: do not reuse the KV blocks of earlier prompts (by default a prompt "
            "that starts like an earlier one computes only the rest).",
        ],
    ]

    optParameters: ClassVar[list[list[Any]]] = [
        [
            "join",
            None,
            None,
            "Join a head: HOST[:PORT] of its fleet listener (port 8455 unless given), or auto to "
            f"find it by DNS-SD ({SERVICE_TYPE}) on the local network. Keeps redialling; with "
            "auto, browses again whenever the head stays unreachable.",
        ],
        [
            "head-name",
            None,
            None,
            "With --join auto: join the head that announces this name (its --head-name, by "
            "default its host name); needed when several heads answer.",
        ],
        ["head", None, None, "Dial the head at this client endpoint and keep reconnecting."],
        ["listen", None, None, "Accept heads on this server endpoint (tcp:0 picks a free port)."],
        ["engine", None, "transformers", f"Generation engine: {' or '.join(ENGINES)}."],
        [
            "model",
            None,
            None,
            "Model folder or .gguf file (default: the bundled "
            f"{DEFAULT_MODEL_NAME}): the transformers engine loads it; with any engine its "
            "tokenizer and chat template are sent to the head, which then needs no model "
            "files (docs/protocol.md section 12.5).",
        ],
        [
            "model-name",
            None,
            None,
            "Model name offered to heads, which route requests by it (default: 'mock' for the "
            f"mock engine without --model, else the model folder name or file stem, else "
            f"{DEFAULT_MODEL_NAME}).",
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
            "status-interval-ms",
            None,
            str(STATUS_INTERVAL_MS),
            "Send each head NODE_STATUS this often (at least 1). A head takes a node silent "
            "for its --keepalive-timeout for hung, so keep this well below that.",
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
            "max-address-handshakes",
            None,
            str(DEFAULT_MAX_ADDRESS_HANDSHAKES),
            "Connections from one address in their handshake at once; more from it are closed "
            "at once, so a few silent connections cannot keep heads out (0: no limit).",
        ],
        [
            "max-sessions",
            None,
            str(DEFAULT_MAX_SESSIONS),
            "Live sessions held at once; an ASSIGN beyond it is refused and that session's "
            "generations are declined, so its head places it elsewhere (0: no limit).",
        ],
        [
            "fenced-grace-ms",
            None,
            str(DEFAULT_FENCED_GRACE_MS),
            "A session whose lease ran out (its head is gone) is kept this long for its head "
            "to come back and reconcile, then deleted with its undelivered events (0: kept "
            "until a new session needs its place).",
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
            "endpoint (default: none); loopback only unless --metrics-insecure. At most 64 "
            "connections, 10 s for a request's headers.",
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
            "kernels",
            None,
            None,
            "transformers: the kernels that multiply the weights: auto (default: the faster on "
            "layer 0, timed at start and kept per CPU), torch (torch's; its int4 and int8 "
            "kernels compute in bfloat16) or native (sfnode's AVX2 kernels, built with the C "
            "compiler; float32 activations).",
        ],
        [
            "speculative",
            None,
            None,
            "transformers: speculative decoding, off (default) or ngram: each decoding "
            "generation drafts its next tokens from n-grams of its own prompt and output, and "
            "one step verifies them; the tokens are those decoding without drafts gives "
            "(docs/engine.md section 3.1).",
        ],
        [
            "draft-tokens",
            None,
            None,
            f"transformers: with --speculative ngram, the most tokens a generation drafts per "
            f"step (default {DEFAULT_DRAFT_TOKENS}).",
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
        self._check_endpoints()
        self._check_join()
        self._check_engine()
        self._check_numbers()
        self._check_modes()
        self._check_token()
        self._check_names()

    def _check_endpoints(self) -> None:
        """Exactly one of --join, --head and --listen, each a valid endpoint; --metrics on
        loopback unless --metrics-insecure."""
        head, listen, join = self["head"], self["listen"], self["join"]
        if sum(value is not None for value in (head, listen, join)) != 1:
            raise usage.UsageError(
                "give exactly one of --join HOST[:PORT], --join auto, --head ENDPOINT or "
                "--listen ENDPOINT"
            )
        if self["metrics"] is not None:
            check_endpoint("metrics", self["metrics"], server=True, example=NODE_SERVER_EXAMPLE)
            if not self["metrics-insecure"] and not is_loopback_listen(self["metrics"]):
                raise usage.UsageError(
                    f"refusing to serve metrics on {self['metrics']} off loopback: listen on a "
                    "loopback interface (interface=127.0.0.1) or pass --metrics-insecure"
                )
        if listen is not None:
            check_endpoint("listen", listen, server=True, example=NODE_SERVER_EXAMPLE)
        elif head is not None:
            check_endpoint("head", head, server=False, example=HEAD_CLIENT_EXAMPLE)

    def _check_engine(self) -> None:
        """A known --engine, and no option of the other engine."""
        engine = self["engine"]
        if engine not in ENGINES:
            raise usage.UsageError(f"--engine must be one of {', '.join(ENGINES)}, not {engine!r}")
        wrong = _TRANSFORMERS_ONLY if engine == "mock" else _MOCK_ONLY
        given = [f"--{name}" for name in wrong if self[name] is not None]
        if engine == "mock":
            given += [
                f"--{flag}"
                for flag in ("stock-kernels", "no-prefix-cache", "eager-step")
                if self[flag]
            ]
        if given:
            raise usage.UsageError(f"{', '.join(given)} cannot be used with --engine {engine}")

    def _check_numbers(self) -> None:
        """Every count and duration as an int in range, with its default when not given."""
        self["max-lanes"] = non_negative("max-lanes", self["max-lanes"], 1, U32_MAX)
        self["status-interval-ms"] = non_negative(
            "status-interval-ms", self["status-interval-ms"], 1, U32_MAX
        )
        for name in _COUNTS:
            self[name] = non_negative(name, self[name])
        for name, default in _COUNTS_WITH_DEFAULTS:
            self[name] = default if self[name] is None else non_negative(name, self[name])
        for name, default in (
            ("prefill-chunk", DEFAULT_PREFILL_CHUNK),
            ("step-tokens", DEFAULT_STEP_TOKENS),
        ):
            value = default if self[name] is None else self[name]
            self[name] = non_negative(name, value, 1, U32_MAX)
        if self["draft-tokens"] is None:
            self["draft-tokens"] = DEFAULT_DRAFT_TOKENS
        else:
            self["draft-tokens"] = non_negative("draft-tokens", self["draft-tokens"], 1, 64)

    def _check_modes(self) -> None:
        """--weights, --speculative, --kernels, --dtype and --device among their values (auto
        when not given), and --model an existing path."""
        for name, modes in (
            ("weights", WEIGHT_MODES),
            ("speculative", SPECULATIVE_MODES),
            ("kernels", KERNEL_MODES),
            ("dtype", DTYPES),
        ):
            self[name] = modes[0] if self[name] is None else self[name]
            if self[name] not in modes:
                raise usage.UsageError(
                    f"--{name} must be one of {', '.join(modes)}, not {self[name]!r}"
                )
        if self["stock-kernels"] and self["weights"] not in ("auto", "float32"):
            raise usage.UsageError(
                f"--weights {self['weights']} needs sfnode's own step; --stock-kernels runs the "
                "model's forward on its float weights"
            )
        self["device"] = "auto" if self["device"] is None else self["device"]
        if not _DEVICE.fullmatch(self["device"]):
            raise usage.UsageError(
                f"--device must be auto, cpu, cuda or cuda:N, not {self['device']!r}"
            )
        if self["model"] is not None and not Path(self["model"]).expanduser().exists():
            raise usage.UsageError(f"--model {self['model']} does not exist")

    def _check_token(self) -> None:
        """``auth-token``: the --auth-file's token (or the default file's), b"" without one;
        and no link off loopback without it unless --insecure-no-auth (docs/protocol.md
        section 5.3: checked here, before makeService loads any model)."""
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
        target: JoinTarget | None = self["join-target"]
        dial = self["head"] if target is None else target.endpoint_string()
        refusal = plaintext_refusal(
            token=self["auth-token"],
            insecure=self["insecure-no-auth"],
            listen=self["listen"],
            dial=dial,
        )
        if refusal is None and self["join-auto"] and not self["auth-token"]:
            if not self["insecure-no-auth"]:
                refusal = (
                    "refusing to join a head found by DNS-SD without a fleet token: give "
                    "--auth-file (the value python -m sfnode token printed on the head's "
                    "machine) or pass --insecure-no-auth"
                )
        if refusal is not None:
            raise usage.UsageError(refusal)

    def _check_names(self) -> None:
        """--identity and --model-name, with their defaults, not empty."""
        if self["identity"] is None:
            self["identity"] = socket.gethostname()
        if not self["identity"]:
            raise usage.UsageError("--identity must not be empty")
        if self["model-name"] is None:
            # The mock engine is offered as "mock"; a model as its folder name or file stem.
            mock = self["engine"] == "mock" and self["model"] is None
            self["model-name"] = "mock" if mock else default_model_name(self["model"])
        if not self["model-name"]:
            raise usage.UsageError("--model-name must not be empty")

    def _check_join(self) -> None:
        """``--join`` and ``--head-name``, typed: ``join-target`` (a JoinTarget, or None) and
        ``join-auto`` (True for ``--join auto``)."""
        self["join-target"] = None
        self["join-auto"] = False
        join, name = self["join"], self["head-name"]
        if join is not None:
            try:
                self["join-target"] = parse_join(join)
            except ValueError as e:
                raise usage.UsageError(f"--join {e}") from None
            self["join-auto"] = self["join-target"] is None
        if name is not None:
            if not self["join-auto"]:
                raise usage.UsageError("--head-name needs --join auto")
            why = valid_head_name(name)
            if why is not None:
                raise usage.UsageError(f"--head-name {name!r} cannot be a head's name: {why}")


_NODE_FIELDS = (
    "model_name",
    "identity",
    "max_lanes",
    "auth_token",
    "handshake_timeout_ms",
    "idle_timeout_ms",
    "status_interval_ms",
    "max_handshakes",
    "max_address_handshakes",
    "max_sessions",
    "fenced_grace_ms",
    "max_unacked_events",
    "max_held_tokens",
    "max_generations",
)
"""The :class:`NodeConfig` fields that are the checked option of the same name as they are."""
_ENGINE_FIELDS = (
    "max_lanes",
    "interactive_lanes",
    "prefill_chunk",
    "step_tokens",
    "speculative",
    "draft_tokens",
    "weights",
    "kernels",
)
"""The :class:`EngineConfig` fields that are the checked option of the same name as they are."""


def _as_given(options: Options, fields: tuple[str, ...]) -> dict[str, Any]:
    """Each of ``fields`` with the value of its option (``max_lanes``: ``--max-lanes``)."""
    return {field: options[field.replace("_", "-")] for field in fields}


def node_config(options: Options) -> NodeConfig:
    """The :class:`NodeConfig` that checked ``options`` describe (a listening node can be
    dialled by a ring neighbour, docs/protocol.md section 12.10)."""
    return NodeConfig(
        **_as_given(options, _NODE_FIELDS),
        drain_timeout_ms=options["drain-timeout"] * 1000,
        listens=options["listen"] is not None,
    )


def engine_config(options: Options) -> EngineConfig:
    """The :class:`EngineConfig` that checked ``options`` describe (the mock engine reads its
    lanes, window and scheduling; the other fields are at their defaults for it)."""
    stock = options["stock-kernels"]
    return EngineConfig(
        **_as_given(options, _ENGINE_FIELDS),
        context_window=options["max-context"] or None,
        kv_blocks=options["kv-blocks"] or None,
        kv_memory=kv_memory(),
        step_ms=float(options["step-ms"]),
        prefix_cache=not options["no-prefix-cache"],
        prefix_cache_blocks=options["prefix-cache-blocks"] or None,
        lean_step=not stock,
        onednn=not stock,
        fused_step=not options["eager-step"],
    )


KV_SHARE = 4
"""Without ``--kv-blocks``, keys and values may take one ``KV_SHARE``-th of the memory the
machine has available at start (docs/engine.md section 3)."""


def kv_memory(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The bytes keys and values may take without ``--kv-blocks``: a share of the machine's
    ``MemAvailable``; None where the machine does not say (no bound)."""
    try:
        for line in meminfo.read_text().splitlines():
            name, _, value = line.partition(":")
            if name == "MemAvailable":
                return int(value.split()[0]) * 1024 // KV_SHARE
    except (OSError, ValueError, IndexError):
        return None
    return None


def build_engine(reactor: Any, options: Options) -> Engine:
    """The engine that ``options`` choose: the one place where an engine is constructed.

    A model sfnode does not support is refused here, in one line naming its architecture (or
    ``model_type``) and what it lacks, before any service starts (docs/engine.md section 5.4).

    :raises NodeModelRefused: the model is one sfnode does not support.
    :raises NodeStartupError: the transformers engine or its model cannot be loaded.
    """
    config = engine_config(options)
    if options["engine"] == "mock":
        from sfnode.engines.mock import MockEngine

        return MockEngine(reactor, config, token_delay_s=options["token-delay-ms"] / 1000.0)
    try:
        from sfnode.engines import embedding
        from sfnode.engines.transformers_engine import TransformersEngine
        from sfnode.engines.weights import loading
        from sfnode.engines.weights.gather import WeightsError
    except ImportError as e:
        raise NodeStartupError(f"sfnode: the transformers engine is not available: {e}") from e
    model = options["model"]
    if model is not None and embedding.is_embedding_folder(Path(model).expanduser()):
        # A sentence-transformers folder: the node serves embeddings (protocol.md 12.7).
        try:
            return embedding.EmbeddingEngine.from_folder(
                reactor, Path(model).expanduser(), options["threads"] or None
            )
        except embedding.EmbeddingModelError as e:
            raise NodeStartupError(f"sfnode: {e}") from e
    try:
        loaded = loading.load_model(
            options["model"],
            dtype=options["dtype"],
            device=options["device"],
            threads=options["threads"] or None,
            cache_dir=options["cache-dir"],
        )
        stock = None if config.lean_step else loading.load_transformers(loaded)
    except ModelRefused as e:
        raise NodeModelRefused(f"sfnode: {e}", str(e)) from e
    except loading.ModelLoadError as e:
        raise NodeStartupError(f"sfnode: {e}") from e
    try:
        if stock is not None:
            return TransformersEngine(stock, reactor, config, tokenizer=loaded.tokenizer)
        return TransformersEngine.from_loaded(loaded, reactor, config)
    except (ValueError, WeightsError) as e:
        raise NodeStartupError(f"sfnode: cannot start the transformers engine: {e}") from e


def head_retry_policy(
    jitter: Callable[[], float] = random.random,
    on_delay: Callable[[int, float], None] | None = None,
) -> RetryPolicy:
    """D9's redial delays: 0.1 s, 0.2 s, 0.4 s, ... up to 2 s for the 1st, 2nd, 3rd, ...
    attempt in a row that did not reach a handshake (:func:`sfnode.linkf.backoff.retry_policy`, the
    head's own policy with the node's cap).  ``on_delay(attempt, delay)`` is told every
    delay (for the log).
    """
    return retry_policy(
        RECONNECT_MAX_S,
        initial_s=RECONNECT_INITIAL_S,
        factor=RECONNECT_FACTOR,
        jitter=jitter,
        on_delay=on_delay,
    )


def _node_layers(protocol: Any) -> tuple[NodeProtocol | None, NoiseProtocol | None]:
    """The node's own protocol inside what a dial built (``ClientService``'s proxy, the Noise
    wrapper), and that wrapper (None without a token)."""
    from sfnode.linkf.noise import NoiseProtocol
    from sfnode.node.protocol import NodeProtocol

    noise = None
    for _ in range(4):
        if isinstance(protocol, NodeProtocol):
            return protocol, noise
        if isinstance(protocol, NoiseProtocol):
            noise = protocol
            protocol = protocol.wrappedProtocol
        else:
            protocol = getattr(protocol, "_protocol", None)
    return None, noise


class HeadDialer:
    """The endpoint of a node that dials its head (``--head``, ``--join``), named for the log;
    it remembers how each attempt ended, so that every redial is logged with the head and the
    real reason, and counts the attempts in a row that did not reach a handshake (the backoff of
    :meth:`retry_policy`).

    Nothing a peer sends makes the node stop dialing (docs/protocol.md section 5.2, D9): a
    connection that fails its handshake (garbage, a silent peer, another fleet token) is a
    failed attempt like a refused connection, logged with its reason and retried with backoff;
    only a connection that passed its handshake sets the backoff back to its first step.

    ``description`` is the head as the operator named it; ``phrase``, when given, says which
    head is dialled now (``--join auto``: "the head 'a' at 10.0.0.1:8455").
    """

    def __init__(
        self,
        endpoint: IStreamClientEndpoint,
        description: str,
        phrase: Callable[[], str] | None = None,
    ) -> None:
        self._endpoint = endpoint
        self.description = description
        self._phrase = phrase
        self._outcome = ""
        self._logged = ""
        self._serious = False
        self.failures = 0
        """Attempts in a row that did not reach a handshake."""

    def head(self) -> str:
        """The head dialled, as log lines name it."""
        if self._phrase is not None:
            return self._phrase()
        return f"the head at {self.description}"

    def connect(self, factory: IProtocolFactory) -> defer.Deferred[Any]:
        attempt = self._endpoint.connect(factory)

        def connected(protocol: Any) -> Any:
            node, noise = _node_layers(protocol)
            if node is not None:
                node.lost.addCallback(lambda _: self._ended(node, noise))
            return protocol

        def failed(failure: Failure) -> Failure:
            from sfnode.discovery.rules import NoHeadFound, SeveralHeads

            self.failures += 1
            if isinstance(failure.value, (NoHeadFound, SeveralHeads)):
                self._outcome = str(failure.value)
                self._serious = isinstance(failure.value, SeveralHeads)
            else:
                self._outcome = f"could not connect: {describe_failure(failure)}"
                self._serious = False
            return failure

        return attempt.addCallbacks(connected, failed)

    def _ended(self, node: NodeProtocol, noise: NoiseProtocol | None) -> None:
        if node.connection is not None and node.connection.handshaken:
            self.failures = 0
            self._serious = False
            self._outcome = "the connection to it ended"
            self._logged = ""
            return
        self.failures += 1
        reason = (
            (noise.failure if noise is not None else None)
            or node.close_reason
            or "it closed the connection (if this repeats, check that it holds the same fleet "
            "token)"
        )
        self._serious = False
        self._outcome = f"the handshake failed: {reason}"

    def retry_policy(self, jitter: Callable[[], float] = random.random) -> Callable[[int], float]:
        """The delays for ``ClientService`` (which counts only attempts that did not connect):
        :func:`head_retry_policy` over :attr:`failures`, each redial logged."""
        policy = head_retry_policy(jitter, on_delay=self.redialling)
        return lambda attempt: policy(max(self.failures, 1))

    def redialling(self, attempt: int, delay: float) -> None:
        """Log a redial: the first after a connection or a new reason, then now and again (a
        head refusing the token again and again is logged once per REDIAL_LOG_EVERY)."""
        if self._outcome == self._logged and attempt % REDIAL_LOG_EVERY:
            return
        self._logged = self._outcome
        emit = log.error if self._serious else log.info
        emit(
            "{head}: {outcome}; redialling in {delay:.1f} s (attempt {attempt})",
            head=self.head(),
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

    _log = Logger(namespace="sfnode.node.tap", observer=_discard)  # type: ignore[arg-type]

    def __init__(self, agent: NodeAgent, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.agent = agent

    def stopService(self) -> defer.Deferred[None]:
        drained = self.agent.drain()
        drained.addCallback(lambda _: ClientService.stopService(self))
        return drained


def node_factory(
    agent: NodeAgent, on_refused: Callable[[str], None] | None = None
) -> IProtocolFactory:
    """The protocol factory of ``agent``, for listening or dialing; all its connections share
    the node.

    Each factory admits at most ``max_handshakes`` connections in their handshake at once, and
    ``max_address_handshakes`` from one address (docs/protocol.md section 5.3).  With a fleet
    token the node is the Noise responder around it (D10), in both dial directions, and
    ``on_refused(peer)`` is told of each peer refused for holding another token (the
    connection is closed either way; nothing stops).
    """
    from sfnode.linkf.noise import Role, secure_factory
    from sfnode.node.protocol import NodeFactory

    config = agent.config
    return secure_factory(
        NodeFactory(agent, config.max_handshakes, config.max_address_handshakes),
        config.auth_token,
        role=Role.RESPONDER,
        clock=agent.clock,
        handshake_timeout_s=config.handshake_timeout_ms / 1000.0,
        on_refused=on_refused,
    )


def join_service(
    reactor: Any, agent: NodeAgent, options: Options, browser: Browser | None = None
) -> HeadDialService:
    """``--join``'s redialling connection: the head at HOST:PORT, or the one DNS-SD finds.

    The same service, backoff and log lines as ``--head``: a head that refuses the node's token
    is logged and redialled with backoff (someone may fix its token).
    """
    target: JoinTarget | None = options["join-target"]
    endpoint: IStreamClientEndpoint
    phrase: Callable[[], str] | None = None
    if target is not None:
        from twisted.internet.endpoints import HostnameEndpoint

        description = str(target)
        endpoint = HostnameEndpoint(reactor, target.host, target.port)
        log.info("sfnode joining the head at {address}", address=description)
    else:
        from sfnode.discovery.join import DiscoveringEndpoint

        if browser is None:
            from sfnode.discovery.dnssd import ZeroconfBrowser

            browser = ZeroconfBrowser(reactor)
        discovering = DiscoveringEndpoint(
            reactor,
            browser,
            HeadFinder(head_name=options["head-name"]),
            has_token=bool(options["auth-token"]),
        )
        description, endpoint, phrase = "auto", discovering, discovering.describe
        log.info(
            "sfnode joining {head} (browsing DNS-SD)",
            head=discovering.describe(),
        )
    dialer = HeadDialer(endpoint, description, phrase)
    return HeadDialService(agent, dialer, node_factory(agent), dialer.retry_policy(), clock=reactor)


def model_files(options: Options) -> Bundle | None:
    """The files a head needs to serve this node's model (docs/protocol.md section 12.5): the
    tokenizer, chat template and configuration of the ``--model`` folder (for a .gguf file,
    or the bundled model, the model files the transformers engine wrote from it into the cache:
    its tokenizer, its ``tokenizer.chat_template`` as ``chat_template.jinja``, a
    ``config.json``).  None, and a log line, when there are none (the mock engine without
    ``--model``, a folder without ``tokenizer.json``): the head then needs ``--model`` for this
    model.
    """
    from sfnode.engines.weights import loading
    from sfnode.linkf.model_files import ModelFilesError, read_bundle

    model = options["model"]
    if options["engine"] == "mock" and model is None:
        return None
    try:
        if model is not None and Path(model).expanduser().is_dir():
            folder = Path(model).expanduser()
        else:
            gguf = Path(model).expanduser() if model is not None else loading.default_gguf()
            folder = loading.gguf_cache_folder(gguf, options["cache-dir"])
        bundle = read_bundle(folder)
    except (ModelFilesError, loading.ModelLoadError) as e:
        log.warn("sfnode offers its head no model files: {error}", error=e)
        return None
    if bundle is None:
        log.info(
            "sfnode offers its head no model files: {folder} has no tokenizer.json", folder=folder
        )
        return None
    log.info(
        "sfnode offers its head the model files of {model} ({hash}, {size} bytes)",
        model=options["model-name"],
        hash=bundle.short_hash,
        size=len(bundle.data),
    )
    return bundle


def makeService(
    options: Options, reactor: Any = None, browser: Browser | None = None
) -> service.MultiService:
    """The node as a service tree named ``sfnode``: ``agent``, then ``listen`` or ``head``.

    ``options`` must have been parsed (``Options().parseOptions([...])``).  ``reactor`` defaults
    to the global one.  The engine (and any model) is loaded here, before the services start.

    With ``--head`` or ``--join`` the node dials its head until the service stops: whatever
    answers there (garbage, a head with another fleet token) is logged and redialled with backoff
    (:class:`HeadDialer`); only a bad configuration, found before this runs, stops a node.
    ``--join auto`` browses DNS-SD through ``browser`` (default: a
    :class:`~sfnode.discovery.dnssd.ZeroconfBrowser`).

    :raises NodeStartupError: the engine cannot be built.
    """
    if reactor is None:
        from twisted.internet import reactor as global_reactor

        reactor = global_reactor
        exit_zero_after_a_clean_stop(reactor)
        progress_bars_only_on_a_terminal()
    from sfnode.node.agent import NodeAgent

    try:
        engine: Engine = build_engine(reactor, options)
        files = model_files(options)
    except NodeModelRefused as refusal:
        # The one line, then the node tells its head why it serves nothing (D25).
        log.error("{line}", line=str(refusal))
        engine, files = RefusedEngine(refusal.reason), None
    agent = NodeAgent(reactor, engine, node_config(options), files)
    withdraw_on_a_failed_check(engine, agent)

    node = service.MultiService()  # type: ignore[no-untyped-call]
    node.setName("sfnode")  # type: ignore[no-untyped-call]
    add_child(node, "agent", AgentService(agent))
    if options["metrics"] is not None:
        from sfnode.node.exporter import metrics_site

        site = metrics_site(agent, reactor)
        add_child(node, "metrics", _listening(reactor, options["metrics"], site, "metrics on"))
    if options["listen"] is not None:
        listen = _listening(reactor, options["listen"], node_factory(agent), "listening on")
        add_child(node, "listen", listen)
    elif options["join"] is not None:
        add_child(node, "head", join_service(reactor, agent, options, browser))
    else:
        add_child(node, "head", head_service(reactor, agent, options["head"]))
    return node


def withdraw_on_a_failed_check(engine: Engine, agent: NodeAgent) -> None:
    """When ``engine``'s start-up check of exactness fails (docs/engine.md section 4.1), the
    engine refuses all work and the node closes its connections: every head shakes hands
    again and reads in HELLO_ACK_F that this node serves no model, with why (D25), so it
    never places on it again.  The node serves while the check runs."""
    checked: defer.Deferred[str | None] | None = getattr(engine, "exactness", None)
    if checked is None:
        return

    def withdraw(problem: str | None) -> str | None:
        if problem is not None:
            log.error(
                "the node withdrew: it serves no model from now on and closes its {n} "
                "connections, so that its heads read why",
                n=len(agent.protocols),
            )
            agent.close_connections(f"the node withdrew: {problem}")
        return problem

    checked.addCallback(withdraw)


def _listening(
    reactor: Any, description: str, factory: IProtocolFactory, what: str
) -> ListeningService:
    """The node's listener on the server endpoint ``description`` (``what``: for the log)."""
    return ListeningService(
        server_from_string(reactor, description),
        factory,
        description,
        what=what,
        program="sfnode",
        error=NodeStartupError,
    )


def head_service(reactor: Any, agent: NodeAgent, description: str) -> HeadDialService:
    """``--head``'s redialling connection to the head at the client endpoint
    ``description``."""
    dialer = HeadDialer(client_from_string(reactor, description), description)
    dial = HeadDialService(agent, dialer, node_factory(agent), dialer.retry_policy(), clock=reactor)
    log.info("sfnode dialing the head at {endpoint}", endpoint=description)
    return dial
