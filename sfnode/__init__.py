"""sfnode: a node agent and a head for fleets that serve large language models.

The node speaks Link F (see ``docs/protocol.md``) to a head, runs generations on an engine
(``sfnode.generation``) and reports its capacity.  This package must never import torch at
module import time: ``twistd --help`` and the wire tests have to stay fast.
"""

__version__ = "0.1.0"
