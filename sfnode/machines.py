"""The node's Automat state machines, under the name the design card gives them.

Connection handshake, session lease (fencing), one generation, the drain: the code lives in
:mod:`sfnode.node.machines` (docs/architecture.md section 2).  This module only names them here
for programs that embed a node; code inside sfnode imports the real home.
"""

from sfnode.node.machines import (
    ConnectionMachine,
    DrainMachine,
    GenerationMachine,
    SessionMachine,
    trace_machine,
)

__all__ = [
    "ConnectionMachine",
    "DrainMachine",
    "GenerationMachine",
    "SessionMachine",
    "trace_machine",
]
