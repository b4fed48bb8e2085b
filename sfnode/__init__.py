"""sfnode: a node agent and a head for fleets that serve large language models.

The node (``sfnode.node``) speaks Link F (``sfnode.linkf``, docs/protocol.md) to a head
(``sfnode.head``), runs generations on an engine (the contract in ``sfnode.generation``, the
engines in ``sfnode.engines``) and reports its capacity; docs/architecture.md section 1 is the
map of the folders.  This package must never import torch at module import time: ``twistd --help``
and the wire tests have to stay fast.  Its own module imports nothing.
"""

__version__ = "0.1.0"
