"""The node's configuration: one frozen value built by the command line or by an embedding program.

Defaults are the ones of docs/protocol.md section 4.4.  Nothing here reads files, the environment or
the clock.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from twisted.internet.interfaces import IReactorTime

    from sfnode.generation import Engine
    from sfnode.linkf.model_files import Bundle

DEFAULT_HANDSHAKE_TIMEOUT_MS = 10_000
DEFAULT_IDLE_TIMEOUT_MS = 120_000
DEFAULT_MAX_LANES = 8
STATUS_INTERVAL_MS = 2_000
COALESCE_TOKENS = 16
COALESCE_MS = 200
DEFAULT_MAX_HANDSHAKES = 64
"""docs/protocol.md section 5.3: connections of one listener in their handshake at once; more are
closed."""
DEFAULT_MAX_ADDRESS_HANDSHAKES = 8
"""docs/protocol.md section 5.3: connections of one listener from one address in their handshake
at once; more from that address are closed."""
DEFAULT_MAX_SESSIONS = 1024
"""Live sessions a node holds at once; an ASSIGN of one more is refused (see NodeConfig)."""
DEFAULT_FENCED_GRACE_MS = 60_000
"""How long a fenced session is kept for its head to come back and reconcile before it is
deleted (docs/protocol.md section 6.4)."""
DEFAULT_MAX_UNACKED_EVENTS = 4096
"""Events of one generation waiting for a WATERMARK_ACK; past it the session is fenced."""
DEFAULT_MAX_HELD_TOKENS = 65_536
"""Tokens one generation may hold while its head does not read; past it the generation stops."""
DEFAULT_MAX_GENERATIONS = 256
"""Generations running or queued on a node at once; more GENERATE_REQs are declined."""
DEFAULT_DRAIN_TIMEOUT_MS = 30_000
DRAIN_ACK_WAIT_MS = 2_000
"""After a drain: how long the node waits for the heads to acknowledge the final events."""


@dataclass(frozen=True)
class NodeConfig:
    """What a node needs to know about itself; shared by all of its connections."""

    model_name: str = "mock"
    identity: str = field(default_factory=socket.gethostname)
    max_lanes: int = DEFAULT_MAX_LANES
    auth_token: bytes = b""
    """The fleet token, already trimmed (docs/protocol.md section 5.4); empty accepts any
    ``Hello.auth``."""
    handshake_timeout_ms: int = DEFAULT_HANDSHAKE_TIMEOUT_MS
    """0 waits for HELLO forever."""
    idle_timeout_ms: int = DEFAULT_IDLE_TIMEOUT_MS
    """0 never drops an idle connection."""
    status_interval_ms: int = STATUS_INTERVAL_MS
    max_handshakes: int = DEFAULT_MAX_HANDSHAKES
    """Per listener; 0 = no limit."""
    max_address_handshakes: int = DEFAULT_MAX_ADDRESS_HANDSHAKES
    """Per listener and peer address; 0 = no limit."""
    max_sessions: int = DEFAULT_MAX_SESSIONS
    """An ASSIGN that would hold one live (not fenced) session more is refused (silently,
    docs/protocol.md section 7.2); the node then answers that session's GENERATE_REQs with
    FINISH_DECLINED, which a head fails over on.  Fenced sessions do not count, but a new
    session takes the place of the one fenced longest ago when the node holds this many
    records.  Advertised as ``CapacitySummary.max_sessions``."""
    fenced_grace_ms: int = DEFAULT_FENCED_GRACE_MS
    """A fenced session is deleted this long after it was fenced unless a new ASSIGN un-fenced
    it (docs/protocol.md section 6.4); 0 = kept until its place is needed."""
    max_unacked_events: int = DEFAULT_MAX_UNACKED_EVENTS
    """Retry-buffer cap per generation; 0 = no cap."""
    max_held_tokens: int = DEFAULT_MAX_HELD_TOKENS
    """Tokens a generation may hold for a head that stopped reading; 0 = no cap."""
    max_generations: int = DEFAULT_MAX_GENERATIONS
    """Running and queued generations; 0 = no cap."""
    drain_timeout_ms: int = DEFAULT_DRAIN_TIMEOUT_MS
    """How long a draining node lets running generations finish before cancelling them."""
    drain_ack_wait_ms: int = DRAIN_ACK_WAIT_MS
    listens: bool = False
    """The node accepts heads (``--listen``), so a ring neighbour can dial it: only then does
    it offer stage rings (docs/protocol.md section 12.10)."""


@dataclass(frozen=True)
class NodeCommon:
    """What every part of one node reads and none owns: the clock, the engine, the
    configuration, the model files it offers (docs/protocol.md section 12.5; None: none) and
    the time base of its sessions (section 6.1)."""

    clock: IReactorTime
    engine: Engine
    config: NodeConfig
    model_files: Bundle | None
    started_at: float
