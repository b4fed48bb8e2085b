"""The head's Link F connection to one node, on Twisted (docs/protocol.md sections 5, 6.5, 8).

Layered like the node side (and like AMP: framing, correlation, schema), one module each:

- :mod:`.protocol`: :class:`HeadLinkProtocol` only turns bytes into typed messages and
  messages into frames (its own send seq, from 1).  It decides nothing; it forwards everything
  to its owner.
- :mod:`.calls`: the correlation table (:class:`CallTable`) of outstanding generations and
  stage forwards, and the :class:`GenerationCall` a caller holds.
- :mod:`.reconcile`: :class:`Reconcile`, one reconnect's reconcile phase, pure.
- :class:`~sfnode.head.link.session.HeadSession` (pure) keeps the bookkeeping and builds messages;
  :class:`~sfnode.head.link.machine.LinkMachine` decides *when*: connecting, handshaking, open,
  reconciling, down (waiting to redial) or closed, with every timer that goes with them.
- :mod:`.node_link`: :class:`NodeLink`, the owner that wires them to the reactor: it carries
  out what the machine asks (dial, say HELLO, reconcile, abort), offers the Deferred API
  (assign, append, generate, stage_forward, ...) and routes each message a node sends through
  its handler table.
- :mod:`.settings`: the one frozen :class:`LinkSettings` value every link is built with, dialed
  or dialed in, and the process-wide :class:`HeadIds`; :mod:`.entry`: :func:`connect_node` and
  :class:`HeadLinkFactory`.

A link the head dials (:func:`connect_node`, or a fleet's ``--node``) redials on its own: at
once when its connection drops, then with the backoff of its retry policy, and reconciles
its sessions on every new connection; generations in flight when the connection dropped wait
for that reconcile and continue when the node still runs them.  A link a node dialed in
(:class:`HeadLinkFactory`) ends with its connection.

:class:`HeadIds` holds the process-wide id spaces (section 8) and the head's identity, a random
64-bit ``head_id`` sent in every HELLO (section 12.4, decision D13), so that a node keeps this
head's sessions apart from any other head's; pass one instance around explicitly.  Until the
HELLO_ACK_F has arrived no frame may be larger than one can be (decision D14).

With a fleet token every connection is Noise (``sfnode.linkf.noise``, D10) with the head as the
initiator, whichever side dialled; ``Hello.auth`` still carries the token inside it.
The reactor and the clock are always parameters: this module must never import the global
reactor, never block, and never let an exception escape ``dataReceived``.
"""

from sfnode.head.link.calls import (
    CallOwner,
    CallTable,
    GenerationAsk,
    GenerationCall,
    GenerationOutcome,
    token_logprobs,
)
from sfnode.head.link.entry import HeadLinkFactory, connect_node
from sfnode.head.link.errors import (
    ConstraintsUnsupportedError,
    LinkLost,
    MalformedFrameError,
    NodeRefused,
    SessionRevokedError,
    SupersededError,
    UnknownSessionError,
)
from sfnode.head.link.machine import (
    ConnectError,
    HandshakeError,
    HandshakeTimeoutError,
    LinkError,
    LinkLostError,
    NodeRefusedError,
    NodeSilentError,
    ReconcileError,
)
from sfnode.head.link.node_link import LinkObserver, NodeLink, embed, stage_batch
from sfnode.head.link.protocol import HeadLinkProtocol, LinkOwner
from sfnode.head.link.reconcile import MAX_RETRY_RANGE, Reconcile
from sfnode.head.link.settings import (
    COMMAND_SPACE,
    DEFAULT_HANDSHAKE_TIMEOUT_S,
    DEFAULT_JOIN_ADDRESS_HANDSHAKES,
    DEFAULT_JOIN_HANDSHAKES,
    DEFAULT_LEASE,
    DEFAULT_LINK_SETTINGS,
    DEFAULT_PARAMS,
    PROTO_RANGE,
    HeadIds,
    LinkSettings,
    describe_endpoint,
    parse_endpoint,
)
from sfnode.runtime.service import describe_failure

__all__ = [
    "COMMAND_SPACE",
    "DEFAULT_HANDSHAKE_TIMEOUT_S",
    "DEFAULT_JOIN_ADDRESS_HANDSHAKES",
    "DEFAULT_JOIN_HANDSHAKES",
    "DEFAULT_LEASE",
    "DEFAULT_LINK_SETTINGS",
    "DEFAULT_PARAMS",
    "MAX_RETRY_RANGE",
    "PROTO_RANGE",
    "CallOwner",
    "CallTable",
    "ConnectError",
    "ConstraintsUnsupportedError",
    "GenerationAsk",
    "GenerationCall",
    "GenerationOutcome",
    "HandshakeError",
    "HandshakeTimeoutError",
    "HeadIds",
    "HeadLinkFactory",
    "HeadLinkProtocol",
    "LinkError",
    "LinkLost",
    "LinkLostError",
    "LinkObserver",
    "LinkOwner",
    "LinkSettings",
    "MalformedFrameError",
    "NodeLink",
    "NodeRefused",
    "NodeRefusedError",
    "NodeSilentError",
    "Reconcile",
    "ReconcileError",
    "SessionRevokedError",
    "SupersededError",
    "UnknownSessionError",
    "connect_node",
    "describe_endpoint",
    "describe_failure",
    "embed",
    "parse_endpoint",
    "stage_batch",
    "token_logprobs",
]
