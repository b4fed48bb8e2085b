"""Generation engines (see :mod:`sfnode.generation` for the interface): the engine loop both
engines run (``loop``), its configuration (``config``), the mock engine (``mock``, pure Python),
the transformers engine (``transformers_engine``) with its scheduler, runners, kernels and
weights in the folders beside it, and the embedding engine (``embedding``) of sentence-transformers
models.

The transformers and embedding engines import torch, so they are imported only when the
operator chooses them; the loop, the configuration, the scheduling and the mock never import
torch.  This package's ``__init__`` holds only the option values the command line names (so
that ``twistd sfnode --help`` needs nothing else) and must never import an engine module
itself.  May import ``sfnode.generation``, ``sfnode.decoding`` and ``sfnode.linkf``.

:class:`ModelLoadError` is the one of :mod:`sfnode.linkf.model_cache` (where the head finds it
too), named here for the engine's modules.
"""

from sfnode.linkf.model_cache import ModelLoadError as ModelLoadError
from sfnode.linkf.model_cache import ModelRefused as ModelRefused

WEIGHT_MODES = ("auto", "float32", "bfloat16", "int8", "int4")
"""The values of ``--weights`` (docs/engine.md section 5); here so that ``twistd sfnode --help``
names them without importing torch."""

KERNEL_MODES = ("auto", "torch", "native")
"""The values of ``--kernels``: measured at start, torch's, or sfnode's own (docs/engine.md
section 5.1)."""

SPECULATIVE_MODES = ("off", "ngram")
"""The values of ``--speculative``: no drafts, or drafts by prompt lookup (docs/engine.md
section 3.1)."""
DEFAULT_DRAFT_TOKENS = 4
"""``--draft-tokens``: the most tokens one lane drafts in a step."""
