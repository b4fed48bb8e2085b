"""``twistd sfhead``: the command line of the fleet head, and the service another program embeds.

:class:`Options` parses and checks the command line without touching the network or loading
anything; :func:`makeService` loads the tokenizer (never model weights) and returns a plain
``MultiService`` named ``sfhead`` with three children: ``fleet`` (dials the ``--node`` endpoints,
keepalives and retries, or the ``--pipeline`` stages), ``fleet-listen`` (nodes that dial in) and
``http`` (the OpenAI-compatible API, ``/healthz`` and ``/metrics``, behind the front door of
``sfnode.head.api.gate`` whose limits are the HTTP options here).  Both listening children log
the address they actually bound, so ``tcp:0`` works.  A fleet listener off loopback adds a
fourth child, ``announce`` (:mod:`sfnode.discovery.announce`: DNS-SD, unless ``--no-announce``).

Stopping the tree (SIGTERM under twistd) drains the head: ``http`` stops listening at once and
answers 503 to requests that still arrive on open connections, completions in flight get up to
``--drain-timeout`` seconds and are then cancelled, and only then does ``fleet`` close the node
links; ``http`` also closes its connections gracefully, so the last bytes of every answer reach
the client before the reactor stops (which would drop unsent data).  Without ``--api-key`` the
HTTP API must stay on loopback unless ``--insecure-http``.

This module must never import torch or transformers at import time or while parsing options
(``twistd --help`` stays fast), and never load model weights: the head only renders and
detokenizes text.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from twisted.application import service
from twisted.internet import defer
from twisted.internet.interfaces import IProtocolFactory, IStreamServerEndpoint
from twisted.logger import Logger
from twisted.protocols.policies import ProtocolWrapper, WrappingFactory
from twisted.python import usage
from twisted.python.failure import Failure

from sfnode.discovery.rules import MAX_HEAD_NAME, SERVICE_TYPE, HeadAnnouncement, valid_head_name
from sfnode.head.api.gate import GateLimits
from sfnode.head.api.grammars import DEFAULT_GRAMMAR_TIMEOUT_S
from sfnode.head.api.keys import KeyFileError, KeyPolicy, parse_key_line
from sfnode.head.api.request_class import (
    DEFAULT_CLASSES,
    DEFAULT_INTERACTIVE_PROMPT_TOKENS,
    ClassRule,
    DefaultClass,
)
from sfnode.head.fleet.fleet import (
    DEFAULT_MAX_GENERATION_S,
    DEFAULT_MAX_QUEUED,
    DEFAULT_NODE_START_S,
    DEFAULT_QUEUE_TIMEOUT_S,
    Fleet,
    FleetSettings,
    Policy,
    default_client_queued,
)
from sfnode.head.fleet.model_admission import DEFAULT_MODEL_GRACE_S
from sfnode.head.fleet.placement import DEFAULT_PREFIX_MAX_SKEW, DEFAULT_PREFIX_WEIGHT, PrefixRule
from sfnode.head.link import DEFAULT_LEASE
from sfnode.head.link.machine import DEFAULT_RETRY_MAX_S, DEFAULT_SILENCE_TIMEOUT_S, RETRY_INITIAL_S
from sfnode.head.models.registry import DEFAULT_MAX_MODEL_BYTES, DEFAULT_MAX_NODE_MODELS
from sfnode.head.models.text import DEFAULT_TEMPLATE_TIMEOUT_S
from sfnode.linkf import model_cache
from sfnode.linkf.fleet_token import read_token
from sfnode.linkf.handshake import is_loopback_listen, plaintext_refusal
from sfnode.linkf.wire import Lease
from sfnode.runtime.service import (
    DEFAULT_MODEL_NAME,
    ListeningService,
    StartupError,
    add_child,
    check_endpoint,
    default_model_name,
    exit_zero_after_a_clean_stop,
    non_negative,
    progress_bars_only_on_a_terminal,
    server_from_string,
)

if TYPE_CHECKING:
    from sfnode.discovery.dnssd import Announcer
    from sfnode.head.api.http import OpenAIApi
    from sfnode.head.fleet.pipeline import PipelineFleet
    from sfnode.head.models.registry import ModelRegistry

log = Logger(namespace="sfnode.head.tap")
_T = TypeVar("_T")

DEFAULT_FLEET_LISTEN = "tcp:8455:interface=127.0.0.1"
DEFAULT_HTTP = "tcp:8453:interface=127.0.0.1"
DEFAULT_DRAIN_TIMEOUT_S = 30.0
POLICIES = tuple(p.value for p in Policy)


class HeadStartupError(StartupError):
    """The head cannot start (tokenizer not loadable, port taken); twistd prints the reason."""


def _check_endpoint(option: str, description: str, *, server: bool) -> None:
    example = "tcp:8455:interface=127.0.0.1" if server else "tcp:127.0.0.1:8454"
    check_endpoint(option, description, server=server, example=example)


def _positive(name: str, value: object) -> int:
    return non_negative(name, value, 1)


def _seconds(name: str, value: object) -> float:
    return _non_negative_number(name, value, unit="seconds")


def _non_negative_number(name: str, value: object, unit: str = "") -> float:
    """``value`` as a finite number of 0 or more (of ``unit``, for the messages)."""
    try:
        number = float(str(value))
    except ValueError as e:
        what = f"a number of {unit}" if unit else "a number"
        raise usage.UsageError(f"--{name} must be {what}, not {value!r}") from e
    if not 0 <= number < float("inf"):
        least = f"0 or more {unit}" if unit else "0 or more"
        raise usage.UsageError(f"--{name} must be {least}, not {value!r}")
    return number


_SIZE_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}


def _size(name: str, value: object) -> int:
    """A byte count: ``4194304``, ``4096k``, ``4M`` or ``1G`` (binary units)."""
    text = str(value).strip().lower().removesuffix("b").removesuffix("i")
    unit = text[-1:] if text[-1:] in _SIZE_UNITS and text[-1:] else ""
    try:
        number = int(text[: len(text) - len(unit)]) * _SIZE_UNITS[unit]
    except ValueError as e:
        raise usage.UsageError(f"--{name} must be a size such as 4M or 65536, not {value!r}") from e
    if number < 1:
        raise usage.UsageError(f"--{name} must be at least 1 byte, not {value!r}")
    return number


def _positive_seconds(name: str, value: object) -> float:
    seconds = _seconds(name, value)
    if seconds <= 0:
        raise usage.UsageError(f"--{name} must be more than 0 seconds, not {value!r}")
    return seconds


def read_api_keys(path: str | Path) -> list[bytes]:
    """The API keys in ``path``: one per line, blank lines and ``#`` comments skipped.

    :raises OSError: the file cannot be read.
    """
    keys = []
    for line in Path(path).expanduser().read_bytes().splitlines():
        line = line.strip()
        if line and not line.startswith(b"#"):
            keys.append(line)
    return keys


def _api_key(key: bytes, where: str) -> bytes:
    """``key`` if it can travel in an ``Authorization: Bearer`` header, else a usage error."""
    if not key:
        raise usage.UsageError(f"{where} is empty")
    if not all(0x21 <= byte <= 0x7E for byte in key):
        raise usage.UsageError(
            f"{where} must be printable ASCII without spaces (it is sent as a bearer token)"
        )
    return key


def _key_policies(lines: list[bytes], path: str, policies: dict[bytes, KeyPolicy]) -> list[bytes]:
    """The keys of a key file's ``lines``, each one's share and caps put in ``policies``
    (docs/api.md "API keys")."""
    keys = []
    for number, line in enumerate(lines, 1):
        try:
            key, policy = parse_key_line(line)
        except KeyFileError as e:
            raise usage.UsageError(f"--api-key-file {path}, key {number}: {e}") from e
        keys.append(_api_key(key, f"--api-key-file {path}"))
        policies[key] = policy
    return keys


class Options(usage.Options):
    """``twistd sfhead`` options; after ``parseOptions`` every value is checked and typed."""

    synopsis = "[--node ENDPOINT ...] [options]"
    longdesc = (
        "Runs a Link F fleet head: accepts nodes on --fleet-listen, dials every --node, places "
        "sessions on them and serves an OpenAI-compatible API on --http. With --pipeline the "
        "head runs each generation across the given stage nodes instead. Without a fleet "
        "token (--auth-file) node links must stay on loopback unless --insecure-no-auth; "
        "without an API key (--api-key or --api-key-file) --http must stay on loopback "
        "unless --insecure-http. A request no live node can take waits (up to --max-queued "
        "requests, each up to --queue-timeout seconds, and on while a --node has not answered "
        "for the first time, up to --node-start-timeout) for a node to come back, join or free a "
        "lane, then gets 503; a --node that cannot be reached is redialled at once and then "
        "with backoff up to --reconnect-max seconds. On SIGTERM the head stops listening for "
        "HTTP, answers 503 to requests on connections still open, lets running completions "
        "finish for up to --drain-timeout seconds, cancels the rest, then exits. A completion "
        "is interactive, batch or background (header X-Request-Class, else the API key's "
        "class, else --default-request-class): interactive ones go first and take lanes back "
        "from the others. Lanes are shared fairly across clients (by API key and its weight, "
        "else by address): a client over its share gives one back to a client that waits. "
        "A stream whose client drops may be resumed with Last-Event-ID (--resume-grace). "
        "Text in messages and string prompts is "
        "tokenized as text: a special token typed by a client (<|im_start|>, ...) never "
        "becomes the special id unless --allow-special-tokens (string prompts only)."
    )

    optFlags: ClassVar[list[list[str | None]]] = [
        ["insecure-no-auth", None, "Allow non-loopback node links without a fleet token."],
        [
            "no-stage-ring",
            None,
            "With --pipeline: send every step of a generation through the head, even when "
            "every stage node can hand steps to the next itself in a stage ring (faster: "
            "docs/protocol.md section 12.10).",
        ],
        [
            "no-announce",
            None,
            f"Do not announce the fleet listener by DNS-SD ({SERVICE_TYPE}); by default a "
            "head whose --fleet-listen is off loopback announces it, so that nodes started "
            "with --join auto find it.",
        ],
        [
            "insecure-http",
            None,
            "Allow --http on a non-loopback address without an API key (anyone who can reach "
            "it may use the API).",
        ],
        [
            "metrics-public",
            None,
            "Answer /metrics without the API key (it needs the key when one is set).",
        ],
        [
            "allow-special-tokens",
            None,
            "Let a /v1/completions string prompt spell special tokens (<|im_start|>, ...) that "
            "become their special ids; by default they are ordinary text, as they always are "
            "in chat messages (a token-id prompt may send any id).",
        ],
        [
            "no-reclaim-lanes",
            None,
            "Never take a lane back from a client that holds more than its share for one "
            "that waits (docs/protocol.md section 8.5, Shares); lanes then go back only as "
            "generations end. Unread streams still give theirs back.",
        ],
    ]

    optParameters: ClassVar[list[list[Any]]] = [
        ["fleet-listen", None, DEFAULT_FLEET_LISTEN, "Accept nodes that dial in here."],
        [
            "head-name",
            None,
            None,
            "The name this head announces by DNS-SD, which nodes pick with --head-name "
            "(default: this host's name).",
        ],
        ["http", None, DEFAULT_HTTP, "Serve the HTTP API here (tcp:0 picks a free port)."],
        [
            "model",
            None,
            None,
            "Model folder, tokenizer folder or .gguf file whose tokenizer and chat template "
            "serve --model-name, whatever nodes send for it (weights are never loaded). "
            "Default: none; nodes send the files of the models they serve (docs/protocol.md "
            f"section 12.5), and the bundled {DEFAULT_MODEL_NAME}'s tokenizer, when installed "
            "here, serves --model-name for nodes that send none.",
        ],
        [
            "model-name",
            None,
            None,
            "The model --model (or the bundled tokenizer) serves, and the model of a request "
            "that names none (default: as twistd sfnode names it).",
        ],
        ["policy", None, Policy.LOAD_AWARE.value, f"Placement: {', '.join(POLICIES)}."],
        [
            "default-request-class",
            None,
            DefaultClass.AUTO.value,
            "Class of a completion without an X-Request-Class header: auto (a prompt of at most "
            "--interactive-prompt-tokens tokens is interactive, a longer one batch), "
            "interactive or batch. Nodes admit interactive requests ahead of batch work.",
        ],
        [
            "interactive-prompt-tokens",
            None,
            str(DEFAULT_INTERACTIVE_PROMPT_TOKENS),
            "With --default-request-class auto: the longest prompt, in tokens, taken for "
            "interactive.",
        ],
        [
            "prefix-weight",
            None,
            f"{DEFAULT_PREFIX_WEIGHT:g}",
            "load-aware placement: how many generations less busy a node counts as per 1,000 "
            "tokens of the prompt it holds in its prefix cache (the head remembers the prompts "
            "it sent each node); more keeps requests that share a prefix together harder, 0 "
            "ignores prefixes.",
        ],
        [
            "prefix-max-skew",
            None,
            str(DEFAULT_PREFIX_MAX_SKEW),
            "load-aware placement: a node with more than this many generations ahead of the "
            "least busy node gets no credit for the prefix it holds.",
        ],
        ["lease-ms", None, str(DEFAULT_LEASE.duration_ms), "Session lease granted to nodes."],
        ["auth-file", None, None, "File holding the fleet token (trimmed of whitespace)."],
        [
            "api-key",
            None,
            None,
            "Require 'Authorization: Bearer KEY' on every /v1 request and on /metrics (unless "
            "--metrics-public; /healthz stays open). --api-key-file keeps the key out of the "
            "process list. Off loopback, serve --http over TLS (ssl:...): a plain tcp: "
            "listener sends the key in clear, and the head warns at start.",
        ],
        [
            "api-key-file",
            None,
            None,
            "File holding the API key, or several, one per line (blank lines and # comments "
            "are skipped); each key has its own --max-key-requests. A key may be followed by "
            "weight=W (its share of the lanes), concurrency=N (its own cap of open "
            "generations), tokens-per-minute=N (429 with Retry-After beyond it), "
            "class=interactive|batch|background (for requests that name none) and admin=yes "
            "(it may drain a node from the console); docs/api.md, API keys.",
        ],
        [
            "drain-timeout",
            None,
            str(int(DEFAULT_DRAIN_TIMEOUT_S)),
            "On SIGTERM: seconds running completions may take to finish before they are "
            "cancelled (new requests get 503 at once).",
        ],
        [
            "max-queued",
            None,
            str(DEFAULT_MAX_QUEUED),
            "Generations that may wait for a lane when no live node can take them, over all "
            "clients (a request with n choices counts n; --max-client-requests and "
            "--max-key-requests apply first); one more gets 503 queue_full at once (0: none "
            "waits).",
        ],
        [
            "max-client-queued",
            None,
            None,
            "Generations one client address may have waiting in that queue (default: a "
            "quarter of --max-queued; 0: no bound but --max-queued); one more gets 429 "
            "rate_limit_exceeded at once.",
        ],
        [
            "queue-timeout",
            None,
            f"{DEFAULT_QUEUE_TIMEOUT_S:g}",
            "Seconds a request waits for a node to come back, join or free a lane before it "
            "gets 503 (0: as long as it takes). A stream whose node died waits the same way.",
        ],
        [
            "node-start-timeout",
            None,
            f"{DEFAULT_NODE_START_S:g}",
            "Seconds a --node may take to answer for the first time (a node's first start "
            "converts and loads its model): until then a request that reaches --queue-timeout "
            "waits on for it instead of getting 503 (0: it does not).",
        ],
        [
            "max-generation-time",
            None,
            f"{DEFAULT_MAX_GENERATION_S:g}",
            "Seconds one generation may take from its request to its end, waiting and failovers "
            "included; past it the head cancels it on its node, frees its lane and answers 504 "
            "generation_timeout (an error event in a stream already answered), so no request "
            "hangs on a node that lost it (0: no limit).",
        ],
        [
            "reconnect-max",
            None,
            f"{DEFAULT_RETRY_MAX_S:g}",
            "Longest wait in seconds between redials of a --node that cannot be reached "
            "(redials start at once, then 0.1 s, doubling, jittered).",
        ],
        [
            "keepalive-timeout",
            None,
            f"{DEFAULT_SILENCE_TIMEOUT_S:g}",
            "Seconds a node link may stay silent (nodes report every 2 s) before the node is "
            "taken for hung: its link is dropped and its streams fail over (0: never).",
        ],
        [
            "pipeline",
            None,
            None,
            "Run generations across these stage nodes: ENDPOINT,ENDPOINT[,...] (in order).",
        ],
        [
            "pipeline-spare",
            None,
            None,
            "Spare stage nodes for --pipeline: ENDPOINT[,...]; a spare takes the layers of a "
            "stage whose node is down, rebuilt from the context the head holds.",
        ],
        # The HTTP front door (sfnode.head.api.gate): limits that hold against hostile clients.
        [
            "max-body",
            None,
            "4M",
            "Largest request body (bytes; k, M, G suffixes): larger ones get 413 before they "
            "are read.",
        ],
        [
            "header-timeout",
            None,
            str(int(GateLimits.header_timeout_s)),
            "Seconds a request's headers may take from their first byte (408 after).",
        ],
        [
            "body-timeout",
            None,
            str(int(GateLimits.body_timeout_s)),
            "Seconds a request's body may take after its headers (408 after).",
        ],
        [
            "stall-timeout",
            None,
            str(int(GateLimits.stall_timeout_s)),
            "Seconds a client may read nothing of its answer before it is cut off and its "
            "generations are cancelled.",
        ],
        [
            "resume-grace",
            None,
            f"{GateLimits.resume_grace_s:g}",
            "Seconds a stream whose client dropped mid-stream waits for it to reconnect with "
            "Last-Event-ID and get the rest (its generations park meanwhile); after that they "
            "are cancelled (0: at once). docs/api.md, Streams that resume.",
        ],
        [
            "max-connections",
            None,
            str(GateLimits.max_connections),
            "Open HTTP connections at most; one more gets 503 and is closed.",
        ],
        [
            "max-client-connections",
            None,
            str(GateLimits.max_client_connections),
            "Open HTTP connections one client address may have; one more gets 429 "
            "too_many_connections and is closed (0: no limit but --max-connections).",
        ],
        [
            "max-client-requests",
            None,
            str(GateLimits.max_client_requests),
            "Generations one client address may have open at once, a request with n choices "
            "counting n (429 beyond; 0: no limit).",
        ],
        [
            "max-key-requests",
            None,
            str(GateLimits.max_key_requests),
            "Generations one API key may have open at once, a request with n choices counting "
            "n (429 beyond; 0: no limit).",
        ],
        [
            "template-timeout",
            None,
            f"{DEFAULT_TEMPLATE_TIMEOUT_S:g}",
            "Seconds the model's chat template may take to render one request's messages; "
            "a template that takes longer is stopped and the request gets 400 "
            "template_timeout (a chat template from an untrusted model file cannot hang the "
            "head).",
        ],
        [
            "grammar-timeout",
            None,
            f"{DEFAULT_GRAMMAR_TIMEOUT_S:g}",
            "Seconds compiling one request's grammar (response_format json_schema, tools) may "
            "take on the head's workers; a grammar that takes longer gets 400 "
            "grammar_timeout, at once on a repeat (a schema's compile can take seconds of "
            "native code).",
        ],
        [
            "model-grace",
            None,
            f"{DEFAULT_MODEL_GRACE_S:g}",
            "Seconds a model that nodes' files brought is still served after its last node "
            "left (a rolling restart keeps it); then it leaves /v1/models, the metrics and "
            "memory, and a request naming it gets 404 model_not_found.",
        ],
        [
            "max-node-models",
            None,
            str(DEFAULT_MAX_NODE_MODELS),
            "The most models this head serves with files nodes send (section 12.5 of "
            "docs/protocol.md); a node naming one more is refused (it stays connected, takes "
            "no requests, and the head logs why).",
        ],
        [
            "max-model-bytes",
            None,
            f"{DEFAULT_MAX_MODEL_BYTES // 1024**2}M",
            "The most bytes of model files from nodes this head keeps (a tokenizer read from "
            "them takes several times their size); a node whose files would pass it is "
            "refused, as with --max-node-models.",
        ],
        [
            "pipeline-layers",
            None,
            None,
            "Layer count N, split by the stage nodes' memory and speed once they report "
            "(evenly while they cannot tell), or the end layer of every stage, e.g. 12,24, "
            "kept as given (default: the model's num_hidden_layers).",
        ],
    ]

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self["nodes"] = []
        self["allowed-hosts"] = []
        self["cors-origins"] = []

    def opt_node(self, endpoint: str) -> None:
        """Dial this node (repeatable)."""
        self["nodes"].append(endpoint)

    def opt_allowed_host(self, name: str) -> None:
        """Answer HTTP requests whose Host header names NAME (repeatable; * for any). IP
        addresses and localhost are always answered; without this option any name is when
        an API key is set (a browser page cannot send the key), none otherwise, so that web
        pages cannot reach an open API through DNS rebinding."""
        self["allowed-hosts"].append(name.strip())

    def opt_cors_origin(self, origin: str) -> None:
        """Give browsers at ORIGIN (e.g. https://app.example) CORS access to the API
        (repeatable; * for any). Without it no CORS headers are sent."""
        self["cors-origins"].append(origin.strip())

    def postOptions(self) -> None:
        """Check every value and replace it by its typed, defaulted form."""
        self._check_endpoints()
        if self["policy"] not in POLICIES:
            raise usage.UsageError(f"--policy must be one of {', '.join(POLICIES)}")
        self["policy"] = Policy(self["policy"])
        self["prefix"] = PrefixRule(
            weight=_non_negative_number("prefix-weight", self["prefix-weight"]),
            max_skew=non_negative("prefix-max-skew", self["prefix-max-skew"]),
        )
        self["lease-ms"] = _positive("lease-ms", self["lease-ms"])
        self._check_class_options()
        if self["model"] is not None and not Path(self["model"]).expanduser().exists():
            raise usage.UsageError(f"--model {self['model']} does not exist")
        if self["model-name"] is None:
            self["model-name"] = default_model_name(self["model"])
        self._check_fleet_token()
        self["drain-timeout"] = _seconds("drain-timeout", self["drain-timeout"])
        if self["head-name"] is None:
            name = socket.gethostname().encode()[:MAX_HEAD_NAME]
            self["head-name"] = name.decode(errors="ignore")
        why = valid_head_name(self["head-name"])
        if why is not None:
            raise usage.UsageError(f"--head-name {self['head-name']!r} cannot be used: {why}")
        self._check_fleet_options()
        self._check_api_key()
        self._check_http_limits()

    def _check_endpoints(self) -> None:
        """The listeners, the nodes to dial, and a pipeline's stages (``self["stages"]``) and
        layers."""
        _check_endpoint("fleet-listen", self["fleet-listen"], server=True)
        _check_endpoint("http", self["http"], server=True)
        for endpoint in self["nodes"]:
            _check_endpoint("node", endpoint, server=False)
        stages: list[str] = []
        if self["pipeline"] is not None:
            if self["nodes"]:
                raise usage.UsageError("--pipeline and --node cannot be used together")
            stages = [s for s in self["pipeline"].split(",") if s]
            if not stages:
                raise usage.UsageError("--pipeline needs at least one ENDPOINT")
            for endpoint in stages:
                _check_endpoint("pipeline", endpoint, server=False)
        self["stages"] = stages
        spares = [s for s in (self["pipeline-spare"] or "").split(",") if s]
        if spares and not stages:
            raise usage.UsageError("--pipeline-spare needs --pipeline")
        for endpoint in spares:
            _check_endpoint("pipeline-spare", endpoint, server=False)
        self["spares"] = spares
        if self["no-stage-ring"] and not stages:
            raise usage.UsageError("--no-stage-ring needs --pipeline")
        layers = self["pipeline-layers"]
        if layers is not None:
            if not stages:
                raise usage.UsageError("--pipeline-layers needs --pipeline")
            values = [_positive("pipeline-layers", v) for v in str(layers).split(",")]
            if len(values) > 1 and len(values) != len(stages):
                raise usage.UsageError(
                    f"--pipeline-layers gives {len(values)} boundaries for {len(stages)} stages"
                )
            self["pipeline-layers"] = values

    def _check_fleet_token(self) -> None:
        """Read the fleet token (``self["auth-token"]``, empty without one) and refuse a
        listener or a dial that would carry Link F in clear off loopback."""
        self["auth-token"] = b""
        if self["auth-file"] is not None:
            try:
                self["auth-token"] = read_token(self["auth-file"])
            except OSError as e:
                raise usage.UsageError(
                    f"cannot read --auth-file {self['auth-file']}: {e.strerror or e}"
                ) from e
        for listen, dial in [(self["fleet-listen"], None)] + [
            (None, e) for e in [*self["nodes"], *self["stages"]]
        ]:
            refusal = plaintext_refusal(
                token=self["auth-token"],
                insecure=bool(self["insecure-no-auth"]),
                listen=listen,
                dial=dial,
                dial_what="the node",
            )
            if refusal is not None:
                raise usage.UsageError(refusal)

    def _check_http_limits(self) -> None:
        """The front door's options, typed, as ``self["limits"]`` (a GateLimits)."""
        self["limits"] = GateLimits(
            max_body=_size("max-body", self["max-body"]),
            header_timeout_s=_positive_seconds("header-timeout", self["header-timeout"]),
            body_timeout_s=_positive_seconds("body-timeout", self["body-timeout"]),
            stall_timeout_s=_positive_seconds("stall-timeout", self["stall-timeout"]),
            resume_grace_s=_seconds("resume-grace", self["resume-grace"]),
            max_connections=_positive("max-connections", self["max-connections"]),
            max_client_connections=non_negative(
                "max-client-connections", self["max-client-connections"]
            ),
            max_client_requests=non_negative("max-client-requests", self["max-client-requests"]),
            max_key_requests=non_negative("max-key-requests", self["max-key-requests"]),
            metrics_public=bool(self["metrics-public"]),
            allowed_hosts=frozenset(h.lower() for h in self["allowed-hosts"] if h),
            cors_origins=frozenset(o for o in self["cors-origins"] if o),
            keys=self["key-policies"],
        )
        self["template-timeout"] = _positive_seconds("template-timeout", self["template-timeout"])
        self["grammar-timeout"] = _positive_seconds("grammar-timeout", self["grammar-timeout"])
        self["model-grace"] = _seconds("model-grace", self["model-grace"])
        if self["model-grace"] < 0:
            raise usage.UsageError("--model-grace must be 0 seconds or more")
        self["max-node-models"] = non_negative("max-node-models", self["max-node-models"])
        self["max-model-bytes"] = _size("max-model-bytes", self["max-model-bytes"])

    def _check_class_options(self) -> None:
        """The request-class rule, typed, as ``self["class-rule"]`` (a ClassRule)."""
        default = str(self["default-request-class"]).strip().lower()
        if default not in DEFAULT_CLASSES:
            raise usage.UsageError(
                f"--default-request-class must be one of {', '.join(DEFAULT_CLASSES)}, not "
                f"{self['default-request-class']!r}"
            )
        self["class-rule"] = ClassRule(
            DefaultClass(default),
            non_negative("interactive-prompt-tokens", self["interactive-prompt-tokens"]),
        )

    def _check_fleet_options(self) -> None:
        """The queue, redial and keepalive settings, typed, and the fleet's settings value
        built from them (``self["fleet-settings"]``)."""
        try:
            self["max-queued"] = int(str(self["max-queued"]))
        except ValueError as e:
            raise usage.UsageError(
                f"--max-queued must be an integer, not {self['max-queued']!r}"
            ) from e
        if self["max-queued"] < 0:
            raise usage.UsageError("--max-queued must be 0 or more")
        if self["max-client-queued"] is None:
            self["max-client-queued"] = default_client_queued(self["max-queued"])
        else:
            self["max-client-queued"] = non_negative("max-client-queued", self["max-client-queued"])
        self["queue-timeout"] = _seconds("queue-timeout", self["queue-timeout"])
        self["node-start-timeout"] = _seconds("node-start-timeout", self["node-start-timeout"])
        self["max-generation-time"] = _seconds("max-generation-time", self["max-generation-time"])
        self["keepalive-timeout"] = _seconds("keepalive-timeout", self["keepalive-timeout"])
        self["reconnect-max"] = _seconds("reconnect-max", self["reconnect-max"])
        if self["reconnect-max"] < RETRY_INITIAL_S:
            raise usage.UsageError(
                f"--reconnect-max must be at least {RETRY_INITIAL_S:g} seconds "
                "(the first redial's delay)"
            )
        lease_ms = self["lease-ms"]
        self["fleet-settings"] = FleetSettings(
            token=self["auth-token"],
            policy=self["policy"],
            lease=Lease(duration_ms=lease_ms, renew_by_ms=lease_ms * 3 // 4),
            silence_timeout_s=self["keepalive-timeout"],
            retry_max_s=self["reconnect-max"],
            max_queued=self["max-queued"],
            max_client_queued=self["max-client-queued"],
            queue_timeout_s=self["queue-timeout"],
            node_start_s=self["node-start-timeout"],
            prefix=self["prefix"],
            max_generation_s=self["max-generation-time"],
            reclaim_lanes=not self["no-reclaim-lanes"],
        )

    def _check_api_key(self) -> None:
        """Read the API key (bytes, or None) and refuse an open API off loopback."""
        key, path = self["api-key"], self["api-key-file"]
        self["key-policies"] = {}
        if key is not None and path is not None:
            raise usage.UsageError("give --api-key or --api-key-file, not both")
        keys: list[bytes] = []
        if key is not None:
            keys = [_api_key(str(key).strip().encode(), "--api-key")]
        elif path is not None:
            try:
                lines = read_api_keys(path)
            except OSError as e:
                raise usage.UsageError(
                    f"cannot read --api-key-file {path}: {e.strerror or e}"
                ) from e
            if not lines:
                raise usage.UsageError(f"--api-key-file {path} is empty")
            keys = _key_policies(lines, path, self["key-policies"])
        self["api-keys"] = tuple(keys)
        self["api-key"] = keys[0] if keys else None
        if (
            self["api-key"] is None
            and not self["insecure-http"]
            and not is_loopback_listen(self["http"])
        ):
            raise usage.UsageError(
                f"refusing to serve HTTP on {self['http']} without an API key: give --api-key "
                "or --api-key-file, listen on a loopback interface (interface=127.0.0.1), or "
                "pass --insecure-http"
            )


def key_in_clear(http: str) -> bool:
    """Whether an API key sent to the ``--http`` endpoint ``http`` crosses the network in
    clear: a listener off loopback that is not TLS (``ssl:``)."""
    kind = http.split(":", 1)[0].strip().lower()
    return kind != "ssl" and not is_loopback_listen(http)


def tokenizer_folder(model: str | None) -> Path | None:
    """The folder holding ``model``'s tokenizer files: the model folder or tokenizer-only
    folder itself, or the converted cache folder of a .gguf file (or of the bundled default);
    None when there is none yet (a GGUF that no node converted)."""
    if model:
        path = Path(model).expanduser()
        if path.is_dir():
            return path
        folder = model_cache.gguf_cache_folder(path)
    else:
        try:
            folder = model_cache.gguf_cache_folder(model_cache.default_gguf())
        except model_cache.ModelLoadError:
            return None
    return folder if folder.is_dir() else None


def load_head_tokenizer(model: str | None) -> Any:
    """The tokenizer (and chat template) of ``model``: a model folder, a tokenizer-only folder,
    a .gguf file, or the bundled default.  Never loads weights.

    A folder with ``tokenizer.json`` is read without torch or transformers
    (:class:`~sfnode.head.models.text.HeadTokenizer`, about a second).  A GGUF file that no node
    converted yet has its model files written first by a child process (``python -m sfnode
    model-files``, the node's own conversion), so the head never maps torch or transformers; only
    a model folder without ``tokenizer.json`` goes through transformers.

    :raises HeadStartupError: it cannot be loaded.
    """
    from sfnode.head.models.text import TOKENIZER_FILE, HeadTokenizer, TokenizerLoadError

    folder = tokenizer_folder(model)
    if folder is None or not (folder / TOKENIZER_FILE).is_file():
        folder = _converted_folder(model) or folder
    if folder is not None and (folder / TOKENIZER_FILE).is_file():
        try:
            return HeadTokenizer(folder)
        except TokenizerLoadError as e:
            raise HeadStartupError(f"sfhead: cannot load the tokenizer: {e}") from e
    log.info(
        "sfhead: no {file} for {model}: loading the tokenizer through transformers (slower)",
        file=TOKENIZER_FILE,
        model=model or "the bundled model",
    )
    try:
        return _transformers_tokenizer(model, folder)
    except Exception as e:
        raise HeadStartupError(f"sfhead: cannot load the tokenizer: {e}") from e


def _converted_folder(model: str | None) -> Path | None:
    """The model files of ``model``'s GGUF file (the bundled one without ``model``), written
    into the cache by a child process; None for a folder.

    :raises HeadStartupError: the child could not write them."""
    try:
        gguf = Path(model).expanduser() if model else model_cache.default_gguf()
    except model_cache.ModelLoadError:
        return None
    if not gguf.is_file():
        return None
    log.info("sfhead: writing the model files of {gguf} (once, in a child process)", gguf=gguf)
    command = [sys.executable, "-m", "sfnode", "model-files", str(gguf)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise HeadStartupError(
            f"sfhead: cannot write the model files of {gguf}: "
            f"{(done.stderr.strip().splitlines() or ['status ' + str(done.returncode)])[-1]}"
        )
    return Path(done.stdout.strip().splitlines()[-1])


def _transformers_tokenizer(model: str | None, folder: Path | None) -> Any:
    """``model``'s tokenizer read by transformers from its folder (a model folder without
    ``tokenizer.json``)."""
    from transformers import AutoTokenizer

    if folder is None:
        raise model_cache.ModelLoadError(f"no tokenizer files for {model or 'the bundled model'}")
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def head_models(options: Options) -> ModelRegistry:
    """The head's model registry at start (sfnode.head.models.registry).

    With ``--model`` (not for a pipeline, which loads it itself): its tokenizer serves
    ``--model-name`` whatever nodes send.  Without: nodes bring their models' files
    (docs/protocol.md section 12.5); the bundled model's tokenizer, when it is installed and
    installed here, serves ``--model-name`` for nodes that send none, until one sends files
    for that name.

    :raises HeadStartupError: ``--model``'s tokenizer cannot be loaded.
    """
    from sfnode.head.models.registry import ModelRegistry
    from sfnode.head.models.text import TOKENIZER_FILE, HeadTokenizer, TokenizerLoadError

    registry = ModelRegistry(
        allow_special_tokens=bool(options["allow-special-tokens"]),
        max_models=options["max-node-models"],
        max_bytes=options["max-model-bytes"],
    )
    name = options["model-name"]
    if options["stages"]:
        return registry
    if options["model"] is not None:
        registry.serve(
            name,
            load_head_tokenizer(options["model"]),
            origin=f"--model {options['model']}",
            vocab_size=model_vocab_size(options["model"]),
            override=True,
        )
        return registry
    folder = tokenizer_folder(None)
    try:
        if folder is not None and (folder / TOKENIZER_FILE).is_file():
            tokenizer = HeadTokenizer(folder)
        else:
            model_cache.default_gguf()  # installed, not converted yet: converted in a child
            tokenizer = load_head_tokenizer(None)
    except (TokenizerLoadError, HeadStartupError, model_cache.ModelLoadError) as e:
        log.info(
            "sfhead has no --model and no bundled tokenizer ({error}): it serves the models "
            "its nodes bring",
            error=e,
        )
        return registry
    registry.serve(
        name,
        tokenizer,
        origin="the bundled tokenizer",
        vocab_size=model_vocab_size(None),
        provisional=True,
    )
    return registry


def model_vocab_size(model: str | None) -> int | None:
    """``vocab_size`` from the model's config.json, when there is one to read (it may exceed
    the tokenizer's: embedding tables are often padded)."""
    folder = tokenizer_folder(model)
    if folder is None:
        return None
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    size = config.get("vocab_size") if isinstance(config, dict) else None
    return size if isinstance(size, int) and size > 0 else None


def model_layers(model: str | None) -> int | None:
    """``num_hidden_layers`` from the model's config.json, when there is one to read."""
    layers = model_config(model).get("num_hidden_layers")
    return int(layers) if isinstance(layers, int) else None


def model_config(model: str | None) -> dict[str, Any]:
    """The model's config.json (empty when there is none to read)."""
    try:
        if model:
            folder = Path(model).expanduser()
            if not folder.is_dir():
                folder = model_cache.gguf_cache_folder(folder)
        else:
            folder = model_cache.gguf_cache_folder(model_cache.default_gguf())
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError, model_cache.ModelLoadError):
        return {}
    return config if isinstance(config, dict) else {}


class HttpConnections(WrappingFactory):
    """The HTTP site's factory, wrapped to know its open connections, so that a drain can close
    them gracefully (flushing what was written) before the reactor stops."""

    noisy = False
    """No "Starting factory" lines (the listener logs where it serves)."""

    def __init__(self, site: IProtocolFactory, reactor: Any) -> None:
        site.noisy = False  # type: ignore[attr-defined]
        super().__init__(site)  # type: ignore[no-untyped-call]
        self._reactor = reactor
        self._closed: list[defer.Deferred[None]] = []

    def unregisterProtocol(self, protocol: ProtocolWrapper) -> None:
        super().unregisterProtocol(protocol)  # type: ignore[no-untyped-call]
        if not self.protocols:
            closed, self._closed = self._closed, []
            for d in closed:
                d.callback(None)

    def close_all(self, grace_s: float) -> defer.Deferred[None]:
        """Close every connection after what it has written; fires once all are closed, or
        after ``grace_s`` seconds (a client that stopped reading is given up on)."""
        if not self.protocols:
            return defer.succeed(None)
        closed: defer.Deferred[None] = defer.Deferred()
        self._closed.append(closed)
        timer = self._reactor.callLater(grace_s, self._give_up, closed)
        closed.addBoth(lambda result: timer.cancel() if timer.active() else None)
        for protocol in list(self.protocols):
            protocol.loseConnection()
        return closed

    def _give_up(self, closed: defer.Deferred[None]) -> None:
        log.warn("{count} HTTP connections did not close in time", count=len(self.protocols))
        if closed in self._closed:
            self._closed.remove(closed)
            closed.callback(None)


class HttpService(ListeningService):
    """The HTTP API's listener; stopping it stops listening, drains the API, then closes the
    connections gracefully.  It runs the probe of the reactor's stalls while it serves
    (sfnode.head.api.workers.StallProbe, its figures in the API's /metrics)."""

    def __init__(
        self,
        endpoint: IStreamServerEndpoint,
        api: Any,
        where: str,
        drain_timeout_s: float,
        reactor: Any,
    ) -> None:
        self.connections = HttpConnections(api.site(), reactor)
        super().__init__(
            endpoint,
            self.connections,
            where,
            what="serving HTTP on",
            program="sfhead",
            error=HeadStartupError,
        )
        self.api = api
        self.drain_timeout_s = drain_timeout_s
        from sfnode.head.api.workers import StallProbe

        self.probe = StallProbe(reactor)
        api.metrics.watch(self.probe.families)

    def startService(self) -> None:
        super().startService()
        self.probe.startService()

    def stopService(self) -> defer.Deferred[None]:
        from sfnode.head.api.http import DRAIN_CANCEL_GRACE_S

        self.probe.stopService()
        stopped = super().stopService()
        drained = self.api.drain(self.drain_timeout_s)
        drained.addCallback(lambda _: self.connections.close_all(DRAIN_CANCEL_GRACE_S))
        drained.addBoth(self._stop_workers)
        return defer.gatherResults([stopped, drained]).addCallback(lambda _: None)

    def _stop_workers(self, result: object) -> object:
        self.api.stop()
        return result


class FleetService(service.Service):
    """Starts the fleet (or the pipeline) with the service tree and stops it with it.

    ``drained``, when given, is waited for before the node links are closed (the HTTP drain:
    streams in progress still need their nodes).
    """

    def __init__(
        self,
        fleet: Fleet,
        nodes: list[str],
        pipeline: Any = None,
        drained: Callable[[], defer.Deferred[None]] | None = None,
    ) -> None:
        self.fleet = fleet
        self.nodes = nodes
        self.pipeline = pipeline
        self.drained = drained

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        if self.pipeline is not None:
            self.pipeline.start().addErrback(self._failed, "the pipeline stages")
            return
        self.fleet.start()
        for endpoint in self.nodes:
            self.fleet.add_node(endpoint).addErrback(self._failed, endpoint)

    def _failed(self, failure: Failure, what: str) -> None:
        log.failure("sfhead could not start {what}", failure, what=what)

    def stopService(self) -> defer.Deferred[None]:
        super().stopService()  # type: ignore[no-untyped-call]
        drained = self.drained() if self.drained is not None else defer.succeed(None)
        stopped = drained.addCallback(lambda _: self.fleet.stop())
        return stopped.addCallback(lambda _: log.info("sfhead stopped"))


def makeService(
    options: Options, reactor: Any = None, announcer: Announcer | None = None
) -> service.MultiService:
    """The head as a service tree named ``sfhead``: ``fleet``, ``fleet-listen``, ``http`` and,
    with a fleet listener off loopback, ``announce``.

    ``options`` must have been parsed.  ``reactor`` defaults to the global one.  The tokenizer
    is loaded here, before the services start.  ``announcer`` announces the fleet listener
    (default: a :class:`~sfnode.discovery.dnssd.ZeroconfAnnouncer`).

    :raises HeadStartupError: the tokenizer cannot be loaded, or a pipeline has no layer count.
    """
    if reactor is None:
        from twisted.internet import reactor as global_reactor

        reactor = global_reactor
        exit_zero_after_a_clean_stop(reactor)
        progress_bars_only_on_a_terminal()
    registry = head_models(options)
    pipeline = _pipeline(options, registry, reactor) if options["stages"] else None
    fleet = pipeline.fleet if pipeline is not None else _fleet(options, registry, reactor)
    api = _api(options, registry, pipeline if pipeline is not None else fleet, reactor, fleet)
    drain_timeout_s = options["drain-timeout"]
    head = service.MultiService()  # type: ignore[no-untyped-call]
    head.setName("sfhead")  # type: ignore[no-untyped-call]
    add_child(
        head,
        "fleet",
        FleetService(fleet, options["nodes"], pipeline, drained=lambda: api.drain(drain_timeout_s)),
    )
    token = options["auth-token"]
    fleet_listener = ListeningService(
        server_from_string(reactor, options["fleet-listen"]),
        fleet.listen_factory(loopback_only=not token and not options["insecure-no-auth"]),
        options["fleet-listen"],
        what="accepting nodes on",
        program="sfhead",
        error=HeadStartupError,
    )
    add_child(head, "fleet-listen", fleet_listener)
    http = server_from_string(reactor, options["http"])
    add_child(head, "http", HttpService(http, api, options["http"], drain_timeout_s, reactor))
    if not options["no-announce"] and not is_loopback_listen(options["fleet-listen"]):
        add_child(head, "announce", _announce(options, fleet_listener, announcer, reactor))
    _log_start(options, registry, fleet if pipeline is None else None)
    return head


def _api(
    options: Options, registry: ModelRegistry, backend: Any, reactor: Any, fleet: Fleet
) -> OpenAIApi:
    """The HTTP API over ``backend`` (the fleet, or the pipeline driver), with the console over
    ``fleet`` (and a pipeline's plan, when ``backend`` is one)."""
    from sfnode.head.api.http import OpenAIApi
    from sfnode.head.console.record import ConsoleRecord
    from sfnode.head.console.state import Console

    record = ConsoleRecord(fleet.registry.events, reactor.seconds)

    return OpenAIApi(
        reactor,
        backend,
        None,
        options["model-name"],
        models=registry,
        api_keys=options["api-keys"],
        limits=options["limits"],
        class_rule=options["class-rule"],
        allow_special_tokens=bool(options["allow-special-tokens"]),
        template_timeout_s=options["template-timeout"],
        grammar_timeout_s=options["grammar-timeout"],
        console=Console(
            fleet,
            record,
            registry.names,
            reactor.seconds,
            stages=backend.plan_report if hasattr(backend, "plan_report") else tuple,
        ),
    )


def _pipeline(options: Options, registry: ModelRegistry, reactor: Any) -> PipelineFleet:
    """The pipeline driver over ``--pipeline``'s stages, serving ``--model``'s tokenizer.

    :raises HeadStartupError: no layer count, or stages and layers that do not match.
    """
    from sfnode.head.fleet.pipeline import PipelineFleet
    from sfnode.head.fleet.stage_plan import model_sizes
    from sfnode.head.models.text import as_codec

    layers = options["pipeline-layers"]
    boundaries = layers if layers is not None and len(layers) > 1 else None
    n_layers = layers[0] if layers is not None and len(layers) == 1 else None
    if boundaries is None and n_layers is None:
        n_layers = model_layers(options["model"])
        if n_layers is None:
            raise HeadStartupError(
                "sfhead: --pipeline needs --pipeline-layers (the model's layer count is "
                "not readable from its config.json)"
            )
    tokenizer = load_head_tokenizer(options["model"])
    registry.serve(
        options["model-name"],
        tokenizer,
        origin=f"--model {options['model'] or 'the bundled model'}",
        vocab_size=model_vocab_size(options["model"]),
        override=True,
    )
    eos = as_codec(tokenizer).eos_token_id
    try:
        return PipelineFleet(
            reactor,
            options["stages"],
            boundaries=boundaries,
            n_layers=n_layers,
            eos_ids=[eos] if isinstance(eos, int) else [],
            settings=options["fleet-settings"],
            spares=options["spares"],
            rings=not options["no-stage-ring"],
            sizes=model_sizes(model_config(options["model"]), n_layers) if n_layers else None,
        )
    except ValueError as e:
        raise HeadStartupError(f"sfhead: {e}") from e


def _fleet(options: Options, registry: ModelRegistry, reactor: Any) -> Fleet:
    """The fleet, admitting nodes by the head's model registry."""
    from sfnode.head.fleet.model_admission import ModelAdmission
    from sfnode.linkf.heap import trim_heap

    models = ModelAdmission(
        registry,
        run=lambda work: _on_a_thread(reactor, work),
        clock=reactor,
        grace_s=options["model-grace"],
        after_drop=lambda: _on_a_thread(reactor, trim_heap),
    )
    return Fleet(reactor, options["fleet-settings"], models=models)


def _announce(
    options: Options, listener: ListeningService, announcer: Announcer | None, reactor: Any
) -> service.Service:
    """The service that announces the fleet listener (DNS-SD) once it is bound."""
    from sfnode.discovery.announce import AnnounceService
    from sfnode.discovery.dnssd import ZeroconfAnnouncer, interface_addresses

    token_required = bool(options["auth-token"])
    announcement = HeadAnnouncement(options["head-name"], token_required=token_required)
    announcer = announcer if announcer is not None else ZeroconfAnnouncer(reactor)
    return AnnounceService(listener, announcement, announcer, interface_addresses)


def _log_start(options: Options, registry: ModelRegistry, fleet: Fleet | None) -> None:
    """Say what the head serves, and warn of an API key that crosses the network in clear
    (``fleet`` None: a pipeline)."""
    if not options["api-keys"]:
        log.info("sfhead HTTP API is open: no API key (--api-key, --api-key-file)")
    elif key_in_clear(options["http"]):
        log.warn(
            "sfhead serves its API key over plain HTTP on {http}, off loopback: anyone on the "
            "path can read the key; listen with ssl:PORT:privateKey=KEY.pem:certKey=CERT.pem "
            "or on a loopback interface",
            http=options["http"],
        )
    policy = "pipeline" if fleet is None else options["policy"].value
    if fleet is not None and fleet.prefix_aware:
        policy += f", prefix weight {options['prefix'].weight:g}, skew {options['prefix'].max_skew}"
    log.info(
        "sfhead serving models {models} ({policy}; nodes {nodes})",
        models=", ".join(registry.names()) + ("" if options["model"] else ", what nodes bring"),
        policy=policy,
        nodes=", ".join(options["stages"] or options["nodes"]) or "dial in",
    )


def _on_a_thread(reactor: Any, work: Callable[[], _T]) -> defer.Deferred[_T]:
    """``work`` on the reactor's thread pool (reading a node's model files: half a second for
    a large tokenizer, which must not stall the streams of other models)."""
    from twisted.internet.threads import deferToThreadPool

    return deferToThreadPool(reactor, reactor.getThreadPool(), work)
