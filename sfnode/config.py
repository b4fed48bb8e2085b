"""The node's configuration: one frozen value built by the command line or by an embedding program.

Defaults are the ones of LINKF 3.5.  Nothing here reads files, the environment or the clock.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

DEFAULT_HANDSHAKE_TIMEOUT_MS = 10_000
DEFAULT_IDLE_TIMEOUT_MS = 120_000
DEFAULT_MAX_LANES = 8
STATUS_INTERVAL_MS = 2_000
COALESCE_TOKENS = 16
COALESCE_MS = 200
RENEW_INTERVAL_MS = 1_000
"""Decision D3: at most one LEASE_RENEW per session per second while in its renew window."""


@dataclass(frozen=True)
class NodeConfig:
    """What a node needs to know about itself; shared by all of its connections."""

    model_name: str = "mock"
    identity: str = field(default_factory=socket.gethostname)
    max_lanes: int = DEFAULT_MAX_LANES
    auth_token: bytes = b""
    """The fleet token, already trimmed (LINKF 4.5); empty accepts any ``Hello.auth``."""
    handshake_timeout_ms: int = DEFAULT_HANDSHAKE_TIMEOUT_MS
    """0 waits for HELLO forever."""
    idle_timeout_ms: int = DEFAULT_IDLE_TIMEOUT_MS
    """0 never drops an idle connection."""
    status_interval_ms: int = STATUS_INTERVAL_MS
