"""The node's capacity summary and its busy-time token rates (docs/protocol.md section 7.5).

Rates are measured over the time the node had at least one generation running, so an idle
node is not read as a slow one, and a rate never decays to zero while idle.  :class:`NodeLoad`
turns the engine's statistics and the node's figures into the ``CapacitySummary`` that
HELLO_ACK_F and every NODE_STATUS carry.

Pure logic: nothing here reads a clock, the engine or the host; every call is given the time
and the figures.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sfnode.generation import EngineStatistics
from sfnode.linkf.wire import U32_MAX, CapacitySummary

MIN_SAMPLE_WINDOW_MS = 200


@dataclass
class BusyTimer:
    """Accumulates the milliseconds during which at least one generation was running."""

    running: int = 0
    accumulated_ms: int = 0
    busy_since_ms: int = 0

    def started(self, now_ms: int) -> None:
        if self.running == 0:
            self.busy_since_ms = now_ms
        self.running += 1

    def stopped(self, now_ms: int) -> None:
        if self.running == 0:
            raise ValueError("stopped() without a matching started()")
        self.running -= 1
        if self.running == 0:
            self.accumulated_ms += max(0, now_ms - self.busy_since_ms)

    def busy_ms(self, now_ms: int) -> int:
        current = max(0, now_ms - self.busy_since_ms) if self.running else 0
        return self.accumulated_ms + current


def _ewma(old: int, sample: int) -> int:
    return sample if old == 0 else (3 * old + sample) // 4


@dataclass
class RateTracker:
    """Decode and prefill EWMAs over busy time, sampled for HELLO_ACK_F and every status."""

    decode_tokens_per_s: int = 0
    prefill_tokens_per_s: int = 0
    _baseline: tuple[int, int, int] | None = None

    def sample(self, busy_ms: int, decoded: int, prefilled: int) -> tuple[int, int]:
        """Take a sample from cumulative counters; return (decode, prefill) tokens per second."""
        if self._baseline is None:
            self._baseline = (busy_ms, decoded, prefilled)
            return self.decode_tokens_per_s, self.prefill_tokens_per_s
        base_busy, base_decoded, base_prefilled = self._baseline
        dt = busy_ms - base_busy
        if dt >= MIN_SAMPLE_WINDOW_MS:
            decode = min((decoded - base_decoded) * 1000 // dt, 0xFFFF_FFFF)
            prefill = min((prefilled - base_prefilled) * 1000 // dt, 0xFFFF_FFFF)
            if decode > 0:
                self.decode_tokens_per_s = _ewma(self.decode_tokens_per_s, decode)
            if prefill > 0:
                self.prefill_tokens_per_s = _ewma(self.prefill_tokens_per_s, prefill)
            self._baseline = (busy_ms, decoded, prefilled)
        return self.decode_tokens_per_s, self.prefill_tokens_per_s


@dataclass
class NodeLoad:
    """What a node's capacity samples are made of: its busy timer and its rate EWMAs."""

    busy: BusyTimer = field(default_factory=BusyTimer)
    rates: RateTracker = field(default_factory=RateTracker)

    def summary(
        self,
        now_ms: int,
        stats: EngineStatistics,
        *,
        host_memory_bytes: int,
        active_sessions: int,
        max_sessions: int,
        max_context_tokens: int,
        max_lanes: int,
    ) -> CapacitySummary:
        """A fresh capacity sample (this takes a rate sample: decision D8 and section 7.5).

        ``max_sessions`` 0 (no limit) is advertised as the largest u32.
        """
        decode, prefill = self.rates.sample(
            self.busy.busy_ms(now_ms), stats.decoded_tokens, stats.prefilled_tokens
        )
        return CapacitySummary(
            host_memory_bytes=host_memory_bytes,
            active_sessions=active_sessions,
            max_sessions=min(max_sessions, U32_MAX) or U32_MAX,
            max_context_tokens=max_context_tokens,
            kv_blocks_used=stats.kv_blocks_used,
            kv_blocks_total=stats.kv_blocks_total,
            lanes_active=stats.lanes_active,
            max_lanes=max_lanes,
            queue_depth=stats.queue_depth,
            decode_tokens_per_s=decode,
            prefill_tokens_per_s=prefill,
            sampled_at_ms=now_ms,
        )
