"""Generation engines that run real models (see :mod:`sfnode.generation` for the interface).

Each engine lives in its own module and is imported only when the operator chooses it, because
those modules import torch.  This package must never import an engine module itself.
"""


class ModelLoadError(Exception):
    """The model (or tokenizer) could not be loaded, or is refused; the message names the path
    or the architecture and the cause (the key and its value, where a key is the cause)."""


WEIGHT_MODES = ("auto", "float32", "bfloat16", "int8", "int4")
"""The values of ``--weights`` (docs/engine.md section 5); here so that ``twistd sfnode --help``
names them without importing torch."""

SPECULATIVE_MODES = ("off", "ngram")
"""The values of ``--speculative``: no drafts, or drafts by prompt lookup (docs/engine.md
section 3.1)."""
DEFAULT_DRAFT_TOKENS = 4
"""``--draft-tokens``: the most tokens one lane drafts in a step."""
