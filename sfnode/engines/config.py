"""How an engine runs: one frozen value, built once by the node's command line
(``sfnode.node.tap.engine_config``) or by a program that embeds an engine, and handed whole to
the engine.

The scheduling fields (lanes, KV blocks, steps, the prefix cache, speculation) mean the same to
every engine that runs the engine loop (:mod:`sfnode.engines.loop`); the weights and kernels
fields are read by the transformers engine only.  Defaults are those of ``twistd sfnode``
(docs/engine.md sections 3 to 5).

This module must never import torch, read files or look at a model: it checks that the values
make sense together and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from sfnode.engines import DEFAULT_DRAFT_TOKENS, KERNEL_MODES, SPECULATIVE_MODES, WEIGHT_MODES
from sfnode.linkf.prefix_blocks import KV_BLOCK_TOKENS

DEFAULT_STEP_MS = 250
"""A step's time budget while interactive work may need the engine (``--step-ms``): a chat that
arrives beside batch work waits about this long for the step in flight."""
DEFAULT_PREFILL_CHUNK = 256
"""``--prefill-chunk``: a prompt is computed in chunks of at most this many tokens."""
DEFAULT_STEP_TOKENS = 512
"""``--step-tokens``: prompt tokens computed per step beside the decoding lanes."""
DEFAULT_MAX_LANES = 8
"""``--max-lanes``: generations decoded at once."""


@dataclass(frozen=True)
class EngineConfig:
    """An engine's configuration (see the module docstring); invalid values raise ValueError
    when the value is built."""

    max_lanes: int = DEFAULT_MAX_LANES
    """Generations decoded at once, each in a KV slot of its own."""
    context_window: int | None = None
    """The most tokens one stream may hold; None: the model's own window (the mock's:
    ``sfnode.engines.mock.MOCK_CONTEXT_WINDOW``).  The transformers engine never exceeds its
    model's window."""
    kv_blocks: int | None = None
    """KV blocks of 16 tokens in the pool; None: a full window for every lane, within
    ``kv_memory``."""
    kv_memory: int | None = None
    """Bytes the keys and values may take when ``kv_blocks`` is not given (the lanes' slots and
    the prefix cache's pool together; the node gives a share of the machine's free memory);
    None: no bound."""
    interactive_lanes: int = 1
    """Lanes kept for interactive requests: batch work holds at most ``max_lanes`` minus these
    (at least one), docs/engine.md section 3."""
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    step_tokens: int = DEFAULT_STEP_TOKENS
    step_ms: float = DEFAULT_STEP_MS
    """The time budget of a step's batch prompt chunks while interactive work may need the
    engine, checked against the step times measured here (0: steps sized by ``step_tokens``
    only; docs/engine.md section 3)."""
    prefix_cache: bool = True
    """Reuse the KV of earlier prompts' blocks (docs/engine.md section 3)."""
    prefix_cache_blocks: int | None = None
    """Blocks the prefix cache keeps; None: as many as ``kv_blocks``."""
    speculative: str = "off"
    """A mode of :data:`~sfnode.engines.SPECULATIVE_MODES`: ``ngram`` drafts up to
    ``draft_tokens`` tokens a lane per step by prompt lookup (docs/engine.md section 3.1)."""
    draft_tokens: int = DEFAULT_DRAFT_TOKENS

    weights: str = "auto"
    """A mode of :data:`~sfnode.engines.WEIGHT_MODES` (docs/engine.md section 5)."""
    kernels: str = "auto"
    """A mode of :data:`~sfnode.engines.KERNEL_MODES`: the family of the quantized kernels
    (``auto``: measured at start, docs/engine.md section 5.1)."""
    dense_copies: bool = False
    """Let long prompt chunks multiply by bfloat16 copies of quantized weights where that is
    measured faster; off by default, since a position's KV then depends on the size of the
    chunk it was computed in (docs/engine.md section 5)."""
    lean_step: bool = True
    """False runs a transformers model's own forward (``--stock-kernels``)."""
    onednn: bool = True
    """The model's own forward routes float32 linear layers to oneDNN."""
    fused_step: bool = True
    """False runs every layer as separate torch operators even where the native fused calls
    could (``--eager-step``, docs/engine.md section 5.2)."""
    weights_cache: Path | None = None
    """Where weights converted for a kernel are kept between starts (beside a GGUF file's model
    files)."""
    eos_ids: frozenset[int] | None = None
    """The ids that end a generation; None: the model's own."""

    def __post_init__(self) -> None:
        if self.max_lanes < 1:
            raise ValueError("max_lanes must be at least 1")
        if self.kv_blocks is not None and self.kv_blocks < 1:
            raise ValueError("kv_blocks must be at least 1")
        if self.prefill_chunk < 1 or self.step_tokens < 1:
            raise ValueError("prefill_chunk and step_tokens must be at least 1")
        if self.step_ms < 0:
            raise ValueError("step_ms must not be negative")
        if self.speculative not in SPECULATIVE_MODES:
            raise ValueError(
                f"speculative must be one of {', '.join(SPECULATIVE_MODES)}, "
                f"not {self.speculative!r}"
            )
        if self.draft_tokens < 1:
            raise ValueError("draft_tokens must be at least 1")
        if self.weights not in WEIGHT_MODES:
            raise ValueError(
                f"weights must be one of {', '.join(WEIGHT_MODES)}, not {self.weights!r}"
            )
        if self.kernels not in KERNEL_MODES:
            raise ValueError(
                f"kernels must be one of {', '.join(KERNEL_MODES)}, not {self.kernels!r}"
            )

    def kv_sizes(self, model_window: int) -> tuple[int, int]:
        """(the context window, the KV blocks of the pool) over a model whose own window is
        ``model_window`` (0: none): the window is the smaller of the model's and
        ``context_window`` (whichever is known), within what the pool holds; the pool is
        ``kv_blocks``, else a full window for every lane.

        :raises ValueError: neither window is known."""
        window = model_window
        if self.context_window:
            window = min(window, self.context_window) if window else self.context_window
        if window <= 0:
            raise ValueError("the model has no max_position_embeddings; pass context_window")
        kv_blocks = self.kv_blocks or -(-window // KV_BLOCK_TOKENS) * self.max_lanes
        return min(window, kv_blocks * KV_BLOCK_TOKENS), kv_blocks

    def within_memory(self, block_bytes: int, model_window: int) -> EngineConfig:
        """This configuration with ``kv_blocks`` set where ``kv_memory`` bounds it: a full
        window for every lane, or the blocks of ``block_bytes`` (one block of 16 positions,
        every layer's keys and values) that ``kv_memory`` holds, slots and pool counted apart
        (at least 256 positions a lane).  Itself when ``kv_blocks`` is given or nothing bounds
        it."""
        if self.kv_blocks is not None or self.kv_memory is None or block_bytes <= 0:
            return self
        _, full = self.kv_sizes(model_window)
        copies = 2 if self.prefix_cache else 1
        fits = self.kv_memory // (copies * block_bytes)
        least = self.max_lanes * (256 // KV_BLOCK_TOKENS)
        return replace(self, kv_blocks=max(least, min(full, fits)))

    def prefix_blocks(self, kv_blocks: int) -> int:
        """The blocks the prefix cache keeps beside a pool of ``kv_blocks``; 0: none."""
        if not self.prefix_cache:
            return 0
        return kv_blocks if self.prefix_cache_blocks is None else self.prefix_cache_blocks


DEFAULT_ENGINE_CONFIG = EngineConfig()
"""The defaults of ``twistd sfnode``."""
