"""The model runners: what executes a step's plan on the worker thread (the Llama runner with
its KV slots, the runner for any causal LM through its own forward), grammar masks computed beside
the forward pass, and pipeline stages' hidden states.

May import ``sfnode.engines.scheduling``, ``sfnode.engines.kernels``, ``sfnode.engines.weights``,
``sfnode.generation``, ``sfnode.decoding`` and ``sfnode.linkf``; never the reactor.
"""
