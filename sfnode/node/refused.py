"""A node that refuses its model: the engine it runs instead of one (docs/protocol.md section
5.2, D25).

A node whose model sfnode does not support says so in one line at start and, when it has a head
to reach (``--head``, ``--join``) or to be reached by (``--listen``), still shakes hands: its
HELLO_ACK_F names no loadable model and carries the refusal, so the head shows it as refused
rather than not at all.  :class:`RefusedEngine` is what such a node's agent runs: it holds no
model, and every generation or stage forward a head asks of it anyway is refused with the
reason (FINISH_REFUSED, a nil stage answer).

This module must never import the engine side (``sfnode.engines``) nor load anything.
"""

from __future__ import annotations

from collections.abc import Sequence

from twisted.internet import defer

from sfnode.generation import (
    EngineRefusal,
    EngineStatistics,
    GenerationRequest,
    GenerationResult,
    StageForwardError,
    StageResult,
    TokenSink,
)

MAX_REASON = 1024
"""The most characters of a refusal a node tells its head (HELLO_ACK_F is at most 8 KiB)."""


class _Refused:
    """A generation refused before it started."""

    def __init__(self, reason: str) -> None:
        self.result: defer.Deferred[GenerationResult] = defer.fail(EngineRefusal(reason))

    def cancel(self) -> None:
        pass


class RefusedEngine:
    """The :class:`~sfnode.generation.Engine` of a node that refused its model: no window, no
    layers, no features, and a refusal for anything asked of it."""

    context_window = 0
    n_layers = 0
    path = "none (the model was refused)"
    supports_logprobs = False
    supports_constraints = False

    def __init__(self, reason: str) -> None:
        self.reason = reason[:MAX_REASON]

    def statistics(self) -> EngineStatistics:
        return EngineStatistics()

    def submit(self, request: GenerationRequest, on_tokens: TokenSink) -> _Refused:
        return _Refused(f"this node serves no model: {self.reason}")

    def stage_forward(
        self, tokens: Sequence[int], start_layer: int, end_layer: int, hidden_in: bytes | None
    ) -> defer.Deferred[StageResult]:
        return defer.fail(StageForwardError(f"this node serves no model: {self.reason}"))

    def start(self) -> None:
        pass

    def stop(self) -> defer.Deferred[None]:
        return defer.succeed(None)


__all__ = ["MAX_REASON", "RefusedEngine"]
