"""The engine interface of the node, and the deterministic mock engine used by protocol tests.

The node agent talks to its engine only through :class:`Engine` (ENGINE.md section 1):

1. ``submit`` a streamed generation; token batches come back on the reactor thread through the
   ``on_tokens`` callback, and the generation's :class:`GenerationResult` through a Deferred;
2. ``statistics`` for NODE_STATUS;
3. ``context_window`` (``max_context_tokens`` in the capacity summary);
4. ``stage_forward`` for pipeline stages (LINKF 6.6).

Every callback and every Deferred of an engine fires on the reactor thread.  An engine that
computes on a worker thread crosses back with ``reactor.callFromThread`` and nothing else.

This module must never import torch: the mock engine is pure Python, and the transformers engine
lives in its own module, imported only when it is chosen.
"""

from __future__ import annotations

import enum
import struct
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import xxhash
from twisted.internet import defer
from twisted.internet.interfaces import IDelayedCall, IReactorTime

from sfnode.wire import GenParams

KV_BLOCK_TOKENS = 16
"""Tokens per KV block; ``kv_blocks_used`` counts ``ceil(tokens / 16)`` per live lane."""


class EngineStop(enum.Enum):
    """Why an engine ended a generation that it ran (a refusal or an error is a failure)."""

    EOS = "eos"
    """The model emitted an EOS id; that id is the last token handed over (decision D6)."""
    LENGTH = "length"
    """``max_new`` tokens were produced, or the context reached the window."""
    EXPIRED = "expired"
    """The wall budget ``max_wall_ms`` ran out."""
    CANCELLED = "cancelled"
    """The node asked the engine to stop (cancel, fence or peer gone)."""


class EngineRefusal(Exception):
    """A client refusal: the request can never run here.  The node answers FINISH_REFUSED."""


class StreamTooLong(EngineRefusal):
    """The prompt is longer than the engine's context window; no token was produced."""

    def __init__(self, prompt_tokens: int, max_tokens: int) -> None:
        super().__init__(
            f"prompt of {prompt_tokens} tokens exceeds the context window of {max_tokens} tokens"
        )
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens


class StageForwardError(Exception):
    """A stage forward that cannot run: bad layer bounds, a malformed hidden blob, no support."""


@dataclass(frozen=True)
class GenerationRequest:
    """One streamed generation: the session's whole context and its budgets."""

    context: Sequence[int]
    params: GenParams
    max_new: int
    max_wall_ms: int = 0
    """0 means no wall budget."""


@dataclass(frozen=True)
class GenerationResult:
    """How a generation that ran ended; ``tokens`` are all tokens handed to ``on_tokens``."""

    tokens: Sequence[int]
    stop: EngineStop


@dataclass(frozen=True)
class EngineStatistics:
    """Live figures of an engine (ENGINE.md 1.2); counters are cumulative since start."""

    decoded_tokens: int = 0
    prefilled_tokens: int = 0
    queue_depth: int = 0
    lanes_active: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0


@dataclass(frozen=True)
class StageResult:
    """The answer of a stage forward: hidden bytes for a middle stage, a token for the last."""

    hidden: bytes | None = None
    token: int | None = None


TokenSink = Callable[[Sequence[int]], None]


class Generation(Protocol):
    """A generation handed to an engine."""

    @property
    def result(self) -> defer.Deferred[GenerationResult]:
        """Fires with the result, or fails with :class:`EngineRefusal` or another error."""

    def cancel(self) -> None:
        """Ask the engine to stop within one decode step; the result then says CANCELLED.

        No ``on_tokens`` call happens after ``cancel`` returns.
        """


class Engine(Protocol):
    """What the node agent needs from a generation engine."""

    @property
    def context_window(self) -> int:
        """The most tokens one stream may hold (0 = unknown or unlimited)."""

    @property
    def n_layers(self) -> int:
        """How many layers stage forwards split."""

    def statistics(self) -> EngineStatistics:
        """A snapshot of the engine's figures."""

    def submit(self, request: GenerationRequest, on_tokens: TokenSink) -> Generation:
        """Queue a generation; tokens arrive in order, each exactly once, on the reactor thread."""

    def stage_forward(
        self, tokens: Sequence[int], start_layer: int, end_layer: int, hidden_in: bytes | None
    ) -> defer.Deferred[StageResult]:
        """Run layers ``[start_layer, end_layer)``; fails with :class:`StageForwardError`."""

    def start(self) -> None:
        """Start workers, if any.  Called once before the first submit."""

    def stop(self) -> defer.Deferred[None]:
        """Cancel everything still queued or running and stop the workers."""
