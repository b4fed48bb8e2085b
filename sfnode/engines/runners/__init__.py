"""The model runners: what executes a step's plan on the worker thread (the decoder runner of
every family, with its KV slots and its attention layout; the runner for any transformers causal
LM through its own forward), grammar masks computed beside the forward pass, and pipeline stages'
hidden states.

May import ``sfnode.engines.scheduling``, ``sfnode.engines.kernels``, ``sfnode.engines.families``,
``sfnode.engines.weights``, ``sfnode.generation``, ``sfnode.decoding`` and ``sfnode.linkf``;
never the reactor.
"""
