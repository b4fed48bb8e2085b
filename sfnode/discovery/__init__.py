"""Finding each other on a network (docs/protocol.md section 5.6): the pure rules, DNS-SD
behind two small interfaces, the endpoint a ``--join auto`` node dials, and the head's announcement.

May import ``sfnode.linkf`` and ``sfnode.runtime``; never the node or the head packages.
"""
