"""The errors a call on a head link fails with (those about connecting and handshaking live
with the machine that raises them, :mod:`sfnode.head.link.machine`, and are re-exported here).

This module must never hold state: it is exception types only.
"""

from __future__ import annotations

from sfnode.head.link.machine import (
    LinkError,
    LinkLostError,
    NodeRefusedError,
)


class MalformedFrameError(LinkError):
    """The node sent bytes that are not Link F; the connection was closed."""


class UnknownSessionError(LinkError):
    """The head did not assign this session on this link."""


class SessionRevokedError(LinkError):
    """The head revoked the session while a call on it was pending."""


class SupersededError(LinkError):
    """The head re-assigned the session at a new epoch; the node drops older generations."""


class ConstraintsUnsupportedError(LinkError):
    """A constrained generation for a node that did not offer FEATURE_CONSTRAINTS (it would
    ignore the constraint, docs/protocol.md section 12.3): never sent."""


LinkLost = LinkLostError
NodeRefused = NodeRefusedError
