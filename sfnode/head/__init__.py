"""The head side of Link F: the bookkeeping and the connections a head keeps to its nodes.

Pure parts first: ``sfnode.head.link.session`` holds the per-connection bookkeeping
(docs/protocol.md section 8), ``sfnode.head.fleet.placement`` decides which node takes a request,
and ``sfnode.head.link.machine`` is the state machine of one link (connecting, handshaking, open,
reconciling, down, closed, with its timers).  ``sfnode.head.link`` drives one node over Twisted
with them, ``sfnode.head.fleet.fleet`` keeps the nodes, the queue and failover, and
``sfnode.head.api.http`` serves the OpenAI-compatible API.  Nothing in this package may import torch
or anything of the node side (``sfnode.node.protocol``): a head only speaks the wire.
"""
