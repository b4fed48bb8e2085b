"""Generation engines that run real models (see :mod:`sfnode.generation` for the interface).

Each engine lives in its own module and is imported only when the operator chooses it, because
those modules import torch.  This package must never import an engine module itself.
"""
