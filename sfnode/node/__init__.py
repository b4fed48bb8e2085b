"""The node agent (``twistd sfnode``): the Link F server side.

Owns the node's protocol (bytes to frames), its machines (connection, lease, generation, drain),
its session tables (``sessions``), the agent that wires them (``agent``), its capacity reports,
configuration, ``/metrics`` exporter and command line (``tap``).  May import ``sfnode.linkf``,
``sfnode.generation``, ``sfnode.decoding``, ``sfnode.discovery`` and ``sfnode.runtime``; only the
command line may import ``sfnode.engines`` (and only once the operator chose an engine).
"""
