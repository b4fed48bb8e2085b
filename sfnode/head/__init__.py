"""The head side of Link F: the bookkeeping and the connections a head keeps to its nodes.

``sfnode.head.session`` holds the pure per-connection bookkeeping of LINKF 7.1 (no I/O);
``sfnode.head.link`` drives one node over Twisted with it.  Nothing in this package may import
torch or anything of the node side (``sfnode.protocol``): a head only speaks the wire.
"""
