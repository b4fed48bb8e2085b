"""The fleet behind the head (docs/protocol.md sections 7 and 8): the nodes and their load
(``nodes``), which node takes a generation (``placement``), the wait queue and its fair order,
failover, the prefix index, which nodes may serve a model (``model_admission``), the embedding
requests (``embeddings``), the pipeline driver, and the ``Backend`` interface the HTTP layer
uses.

May import ``sfnode.head.link``, ``sfnode.head.models``, ``sfnode.generation`` and
``sfnode.linkf``; never the HTTP layer.
"""
