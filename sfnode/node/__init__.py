"""The node agent (``twistd sfnode``): the Link F server side.

Owns the node's protocol (bytes to frames, ``protocol``), its machines (connection, lease,
generation, drain: ``machines``), the session records and their rules (``sessions``), the
session tables per head (``heads``), the running generations (``generations``), what it does
with each message (``responders``), what it reports to its heads (``reports``, ``capacity``),
the agent that builds and wires them (``agent``), its configuration, ``/metrics`` exporter and
command line (``tap``).  May import ``sfnode.linkf``, ``sfnode.generation``, ``sfnode.decoding``
and ``sfnode.runtime``; only the command line may import ``sfnode.engines`` (and only once the
operator chose an engine) and ``sfnode.discovery``.  The exporter reads the engine through its
``statistics()`` alone.
"""
