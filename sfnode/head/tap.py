"""``twistd sfhead``: the command line of the fleet head, and the service another program embeds.

:class:`Options` parses and checks the command line without touching the network or loading
anything; :func:`makeService` loads the tokenizer (never model weights) and returns a plain
``MultiService`` named ``sfhead`` with three children: ``fleet`` (dials the ``--node`` endpoints,
keepalives and retries, or the ``--pipeline`` stages), ``fleet-listen`` (nodes that dial in) and
``http`` (the OpenAI-compatible API, ``/healthz`` and ``/metrics``).  Both listening children log
the address they actually bound, so ``tcp:0`` works.

This module must never import torch or transformers at import time or while parsing options
(``twistd --help`` stays fast), and never load model weights: the head only renders and
detokenizes text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

from twisted.application import service
from twisted.internet import defer
from twisted.internet.interfaces import IListeningPort, IProtocolFactory, IStreamServerEndpoint
from twisted.logger import Logger
from twisted.python import usage
from twisted.python.failure import Failure

from sfnode.admission import plaintext_refusal
from sfnode.head.fleet import Fleet, Policy
from sfnode.head.link import DEFAULT_LEASE
from sfnode.tap import (
    DEFAULT_MODEL_NAME,
    client_from_string,
    describe_address,
    server_from_string,
)
from sfnode.tokens import read_token
from sfnode.wire import Lease

log = Logger(namespace="sfnode.head.tap")

DEFAULT_FLEET_LISTEN = "tcp:8455:interface=127.0.0.1"
DEFAULT_HTTP = "tcp:8453:interface=127.0.0.1"
POLICIES = tuple(p.value for p in Policy)


class HeadStartupError(SystemExit):
    """The head cannot start (tokenizer not loadable, port taken); twistd prints the reason."""


def default_model_name(model: str | None) -> str:
    """The model name served (and asked of nodes): the folder name or file stem, else the
    bundled default's name, exactly as ``twistd sfnode`` offers it."""
    if not model:
        return DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    return path.name if path.is_dir() else path.stem


def _check_endpoint(option: str, description: str, *, server: bool) -> None:
    """A usage error unless ``description`` parses as a server (or client) endpoint string."""
    parse = server_from_string if server else client_from_string
    try:
        parse(object(), description)
    except Exception as e:
        example = "tcp:8455:interface=127.0.0.1" if server else "tcp:127.0.0.1:8454"
        raise usage.UsageError(
            f"--{option} {description!r} is not a {'server' if server else 'client'} endpoint "
            f"string: {e} (for example {example})"
        ) from e


def _positive(name: str, value: object) -> int:
    try:
        number = int(str(value))
    except ValueError as e:
        raise usage.UsageError(f"--{name} must be an integer, not {value!r}") from e
    if number < 1:
        raise usage.UsageError(f"--{name} must be at least 1, not {value!r}")
    return number


class Options(usage.Options):
    """``twistd sfhead`` options; after ``parseOptions`` every value is checked and typed."""

    synopsis = "[--node ENDPOINT ...] [options]"
    longdesc = (
        "Runs a Link F fleet head: accepts nodes on --fleet-listen, dials every --node, places "
        "sessions on them and serves an OpenAI-compatible API on --http. With --pipeline the "
        "head runs each generation across the given stage nodes instead. Without a fleet "
        "token (--auth-file) node links must stay on loopback unless --insecure-no-auth."
    )

    optFlags: ClassVar[list[list[str | None]]] = [
        ["insecure-no-auth", None, "Allow non-loopback node links without a fleet token."],
    ]

    optParameters: ClassVar[list[list[Any]]] = [
        ["fleet-listen", None, DEFAULT_FLEET_LISTEN, "Accept nodes that dial in here."],
        ["http", None, DEFAULT_HTTP, "Serve the HTTP API here (tcp:0 picks a free port)."],
        [
            "model",
            None,
            None,
            "Model folder, tokenizer folder or .gguf file for the tokenizer and chat template "
            f"(default: the bundled {DEFAULT_MODEL_NAME}); weights are never loaded.",
        ],
        [
            "model-name",
            None,
            None,
            "Model name served and asked of nodes (default: as twistd sfnode names it).",
        ],
        ["policy", None, Policy.LOAD_AWARE.value, f"Placement: {', '.join(POLICIES)}."],
        ["lease-ms", None, str(DEFAULT_LEASE.duration_ms), "Session lease granted to nodes."],
        ["auth-file", None, None, "File holding the fleet token (trimmed of whitespace)."],
        [
            "pipeline",
            None,
            None,
            "Run generations across these stage nodes: ENDPOINT,ENDPOINT[,...] (in order).",
        ],
        [
            "pipeline-layers",
            None,
            None,
            "Layer count N (split evenly) or the end layer of every stage, e.g. 12,24 "
            "(default: the model's num_hidden_layers).",
        ],
    ]

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self["nodes"] = []

    def opt_node(self, endpoint: str) -> None:
        """Dial this node (repeatable)."""
        self["nodes"].append(endpoint)

    def postOptions(self) -> None:
        """Check every value and replace it by its typed, defaulted form."""
        _check_endpoint("fleet-listen", self["fleet-listen"], server=True)
        _check_endpoint("http", self["http"], server=True)
        for endpoint in self["nodes"]:
            _check_endpoint("node", endpoint, server=False)
        if self["policy"] not in POLICIES:
            raise usage.UsageError(f"--policy must be one of {', '.join(POLICIES)}")
        self["policy"] = Policy(self["policy"])
        self["lease-ms"] = _positive("lease-ms", self["lease-ms"])
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
        if self["model"] is not None and not Path(self["model"]).expanduser().exists():
            raise usage.UsageError(f"--model {self['model']} does not exist")
        if self["model-name"] is None:
            self["model-name"] = default_model_name(self["model"])
        self["auth-token"] = b""
        if self["auth-file"] is not None:
            try:
                self["auth-token"] = read_token(self["auth-file"])
            except OSError as e:
                raise usage.UsageError(
                    f"cannot read --auth-file {self['auth-file']}: {e.strerror or e}"
                ) from e
        for listen, dial in [(self["fleet-listen"], None)] + [
            (None, e) for e in [*self["nodes"], *stages]
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


def load_head_tokenizer(model: str | None) -> Any:
    """The tokenizer (and chat template) of ``model``: a model folder, a tokenizer-only folder,
    a .gguf file, or the bundled default.  Never loads weights.

    :raises HeadStartupError: it cannot be loaded.
    """
    from sfnode import models

    try:
        if model:
            path = Path(model).expanduser()
            if path.is_dir() and not (path / "config.json").is_file():
                from transformers import AutoTokenizer

                return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        return models.load_tokenizer(model)
    except Exception as e:
        raise HeadStartupError(f"sfhead: cannot load the tokenizer: {e}") from e


def model_layers(model: str | None) -> int | None:
    """``num_hidden_layers`` from the model's config.json, when there is one to read."""
    from sfnode import models

    try:
        if model:
            folder = Path(model).expanduser()
            if not folder.is_dir():
                folder = models.gguf_cache_folder(folder)
        else:
            folder = models.gguf_cache_folder(models.default_gguf())
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError, models.ModelLoadError):
        return None
    layers = config.get("num_hidden_layers")
    return int(layers) if isinstance(layers, int) else None


class ListeningService(service.Service):
    """Listens on an endpoint while running and logs the address it bound."""

    def __init__(
        self, endpoint: IStreamServerEndpoint, factory: IProtocolFactory, what: str, where: str
    ) -> None:
        self.endpoint = endpoint
        self.factory = factory
        self.what = what
        self.where = where
        self.port: IListeningPort | None = None
        self.bound: defer.Deferred[IListeningPort] | None = None

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        failures: list[Failure] = []
        listening = self.endpoint.listen(self.factory)
        listening.addCallbacks(self._bound, failures.append)
        if failures:
            self.running = False
            raise HeadStartupError(f"sfhead: cannot listen on {self.where}: {failures[0].value}")
        self.bound = listening

    def _bound(self, port: IListeningPort) -> IListeningPort:
        self.port = port
        log.info("sfhead {what} on {address}", what=self.what, address=describe_address(
            port.getHost()
        ))
        return port

    def stopService(self) -> defer.Deferred[None]:
        super().stopService()  # type: ignore[no-untyped-call]
        port, self.port = self.port, None
        if port is None:
            return defer.succeed(None)
        stopped = port.stopListening()
        return stopped if stopped is not None else defer.succeed(None)


class FleetService(service.Service):
    """Starts the fleet (or the pipeline) with the service tree and stops it with it."""

    def __init__(self, fleet: Fleet, nodes: list[str], pipeline: Any = None) -> None:
        self.fleet = fleet
        self.nodes = nodes
        self.pipeline = pipeline

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
        stopped = self.fleet.stop()
        return stopped.addCallback(lambda _: log.info("sfhead stopped"))


def makeService(options: Options, reactor: Any = None) -> service.MultiService:
    """The head as a service tree named ``sfhead``: ``fleet``, ``fleet-listen``, ``http``.

    ``options`` must have been parsed.  ``reactor`` defaults to the global one.  The tokenizer
    is loaded here, before the services start.

    :raises HeadStartupError: the tokenizer cannot be loaded, or a pipeline has no layer count.
    """
    if reactor is None:
        from twisted.internet import reactor as global_reactor

        reactor = global_reactor
    from sfnode.head.http import OpenAIApi
    from sfnode.head.pipeline import PipelineFleet

    tokenizer = load_head_tokenizer(options["model"])
    lease_ms = options["lease-ms"]
    lease = Lease(duration_ms=lease_ms, renew_by_ms=lease_ms * 3 // 4)
    token = options["auth-token"]
    pipeline: PipelineFleet | None = None
    backend: Any
    if options["stages"]:
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
        eos = getattr(tokenizer, "eos_token_id", None)
        try:
            pipeline = PipelineFleet(
                reactor,
                options["stages"],
                boundaries=boundaries,
                n_layers=n_layers,
                eos_ids=[eos] if isinstance(eos, int) else [],
                token=token,
            )
        except ValueError as e:
            raise HeadStartupError(f"sfhead: {e}") from e
        fleet = pipeline.fleet
        fleet.lease = lease
        backend = pipeline
    else:
        fleet = Fleet(reactor, token=token, policy=options["policy"], lease=lease)
        backend = fleet
    api = OpenAIApi(reactor, backend, fleet, tokenizer, options["model-name"])

    head = service.MultiService()  # type: ignore[no-untyped-call]
    head.setName("sfhead")  # type: ignore[no-untyped-call]
    _add_child(head, "fleet", FleetService(fleet, options["nodes"], pipeline))
    _add_child(
        head,
        "fleet-listen",
        ListeningService(
            server_from_string(reactor, options["fleet-listen"]),
            fleet.listen_factory(),
            "accepting nodes",
            options["fleet-listen"],
        ),
    )
    _add_child(
        head,
        "http",
        ListeningService(
            server_from_string(reactor, options["http"]), api.site(), "serving HTTP",
            options["http"],
        ),
    )
    log.info(
        "sfhead serving model {model} ({policy}; nodes {nodes})",
        model=options["model-name"],
        policy="pipeline" if pipeline is not None else options["policy"].value,
        nodes=", ".join(options["stages"] or options["nodes"]) or "dial in",
    )
    return head


def _add_child(parent: service.MultiService, name: str, child: service.Service) -> None:
    child.setName(name)  # type: ignore[no-untyped-call]
    child.setServiceParent(parent)  # type: ignore[no-untyped-call]
