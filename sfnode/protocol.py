"""The node's Link F protocol, under the name the design card gives it.

A Twisted protocol frames Link F bytes and hands the frames to the node's connection machine;
the code lives in :mod:`sfnode.node.protocol` (docs/architecture.md section 2).  This module
only names it here for programs that embed a node; code inside sfnode imports the real home.
"""

from sfnode.node.protocol import ConnectionHost, NodeConnection, NodeFactory, NodeProtocol

__all__ = ["ConnectionHost", "NodeConnection", "NodeFactory", "NodeProtocol"]
