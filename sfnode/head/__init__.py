"""The head (``twistd sfhead``): it accepts nodes, places generations on them, fails over, and
serves the OpenAI-compatible API.

Five folders, bottom to top (docs/architecture.md section 1): ``link/`` (one node's Link F link:
framing, its machine, its session bookkeeping, the call table), ``models/`` (the models served:
registry, tokenizer and templates, tool calls), ``fleet/`` (nodes, placement, the queues,
failover, the pipeline driver, the ``Backend`` the API uses), ``console/`` (the operator's
view of the fleet) and ``api/`` (the HTTP front);
``tap.py`` builds them into a service.  Nothing here may import torch, the engine or the node
(``sfnode.node``): a head only speaks the wire.  This package's own module imports nothing.
"""
