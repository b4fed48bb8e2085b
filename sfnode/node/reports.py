"""What a node tells its heads about itself: HELLO_ACK_F and NODE_STATUS (docs/protocol.md
sections 5.1 and 7.5), each with a fresh capacity sample.

:class:`NodeReports` owns the node's busy-time load (:class:`~sfnode.node.capacity.NodeLoad`),
which the generations start and stop, and builds every report from the engine's statistics,
the node's configuration and its session count.  It never sends: the connections do.
"""

from __future__ import annotations

from collections.abc import Callable

import psutil

from sfnode.generation import Embedder, kept_stages_of
from sfnode.linkf.platform import NodePlatform, encode_platform
from sfnode.linkf.wire import (
    FEATURE_CLOSING,
    FEATURE_CONSTRAINTS,
    FEATURE_EMBEDDINGS,
    FEATURE_HEAD_IDENTITY,
    FEATURE_LOGPROBS,
    FEATURE_MODEL_FILES,
    FEATURE_REQUEST_CLASS,
    FEATURE_STAGE_BATCH,
    FEATURE_STAGE_KV,
    FEATURE_STAGE_RING,
    PROTO_VERSION,
    CapacitySummary,
    HelloAckF,
    LinkFLimits,
    MemCountersMsg,
    ModelFilesOffer,
    NodeStatusMsg,
    TelemetryMsg,
)
from sfnode.node.capacity import NodeLoad
from sfnode.node.config import NodeCommon
from sfnode.node.host import cpu_description, resident_bytes
from sfnode.node.refused import MAX_REASON, RefusedEngine


def _keeps_stages(engine: object) -> bool:
    """Whether the engine's pipeline stages keep their KV (docs/protocol.md section 12.8)."""
    return kept_stages_of(engine) is not None


class NodeReports:
    """HELLO_ACK_F, NODE_STATUS and the capacity summary both carry (decision D8)."""

    def __init__(
        self,
        common: NodeCommon,
        *,
        now_ms: Callable[[], int],
        live_sessions: Callable[[], int],
    ) -> None:
        self._common = common
        self._now_ms = now_ms
        self._live_sessions = live_sessions
        self.load = NodeLoad()
        """The busy time and rates; generations start and stop its busy timer."""
        self._host_memory_bytes = int(psutil.virtual_memory().total)
        self._cpu = cpu_description()

    def generation_started(self) -> None:
        self.load.busy.started(self._now_ms())

    def generation_ended(self) -> None:
        self.load.busy.stopped(self._now_ms())

    @property
    def rates(self) -> tuple[int, int]:
        """The latest busy-time (decode, prefill) tokens per second, without a new sample."""
        rates = self.load.rates
        return rates.decode_tokens_per_s, rates.prefill_tokens_per_s

    def capacity(self) -> CapacitySummary:
        """A fresh capacity sample (section 7.5 and decision D8)."""
        return self.load.summary(
            self._now_ms(),
            self._common.engine.statistics(),
            host_memory_bytes=self._host_memory_bytes,
            active_sessions=self._live_sessions(),
            max_sessions=self._common.config.max_sessions,
            max_context_tokens=self._common.engine.context_window,
            max_lanes=self._common.config.max_lanes,
        )

    @property
    def refused(self) -> str | None:
        """Why this node serves no model (it refused it at start, D25, or its engine withdrew
        after a failed start-up check: its ``refusal``); None when it serves one."""
        engine = self._common.engine
        if isinstance(engine, RefusedEngine):
            return engine.reason
        withdrawn = getattr(engine, "refusal", None)
        return withdrawn[:MAX_REASON] if isinstance(withdrawn, str) else None

    @property
    def loadable_models(self) -> tuple[str, ...]:
        """The model it names: none when it refused its model."""
        return () if self.refused is not None else (self._common.config.model_name,)

    def hello_ack(self) -> HelloAckF:
        files = self._common.model_files
        return HelloAckF(
            chosen_version=PROTO_VERSION,
            node_identity=self._common.config.identity,
            capacity=self.capacity(),
            loadable_models=self.loadable_models,
            # Every engine reads GenerationRequest.interactive (section 12.2).
            feature_flags=FEATURE_REQUEST_CLASS
            | FEATURE_HEAD_IDENTITY
            | (FEATURE_LOGPROBS if self._common.engine.supports_logprobs else 0)
            | (FEATURE_CONSTRAINTS if self._common.engine.supports_constraints else 0)
            # An engine loop with a vocabulary closes constrained output within its budget.
            | (FEATURE_CLOSING if self._common.engine.supports_constraints else 0)
            | (FEATURE_MODEL_FILES if files is not None else 0)
            | (FEATURE_EMBEDDINGS if isinstance(self._common.engine, Embedder) else 0)
            | (FEATURE_STAGE_KV | FEATURE_STAGE_BATCH if _keeps_stages(self._common.engine) else 0)
            # Rings only where a neighbour can dial this node (section 12.10).
            | (FEATURE_STAGE_RING if self._offers_rings() else 0),
            limits=LinkFLimits(),
            model_files=(
                ModelFilesOffer(files.content_hash, len(files.data)) if files is not None else None
            ),
            refused=self.refused,
        )

    def _offers_rings(self) -> bool:
        """Stage rings (section 12.10): kept stages, and a listening node."""
        return self._common.config.listens and _keeps_stages(self._common.engine)

    def platform(self) -> TelemetryMsg:
        """The TELEMETRY that follows HELLO_ACK_F: the CPU and the engine's path (section
        12.9, D27)."""
        platform = NodePlatform(self._cpu, self._common.engine.path)
        return TelemetryMsg(spans=encode_platform(platform))

    def status(self) -> NodeStatusMsg:
        capacity = self.capacity()
        return NodeStatusMsg(
            capacity=capacity,
            loadable_models=self.loadable_models,
            mem=MemCountersMsg(
                # The node's resident memory (D27); upstream leaves it 0.
                host_retained_bytes=resident_bytes() or 0,
                pool_blocks_total=capacity.kv_blocks_total,
                pool_blocks_used=capacity.kv_blocks_used,
            ),
        )
