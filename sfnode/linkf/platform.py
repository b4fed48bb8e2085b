"""What a node runs on, as it tells its heads (docs/protocol.md section 12.9, decision D27): the
CPU and the way its engine computes, carried in a TELEMETRY message's ``spans`` as a msgpack map
``{"cpu": str, "engine": str}``.

TELEMETRY is droppable and ignored by every receiver that does not read it (section 3), so a
node sends this to any head, and a head reads it only when it is exactly such a map.  This
module is pure: it never sends, and never raises on what a peer sent.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

PLATFORM_TEXT_MAX = 200
"""The longest ``cpu`` or ``engine`` text, in characters (longer ones are cut on send and
refused on receipt)."""


@dataclass(frozen=True, slots=True)
class NodePlatform:
    """The CPU a node runs on (its model name and vector extensions) and how its engine
    computes (``native step, q4_1 weights``, ``torch operators, float32 weights``, ``mock``)."""

    cpu: str
    engine: str


def encode_platform(platform: NodePlatform) -> bytes:
    """The ``spans`` of the TELEMETRY that carries ``platform``."""
    spans: bytes = msgpack.packb(
        {
            "cpu": platform.cpu[:PLATFORM_TEXT_MAX],
            "engine": platform.engine[:PLATFORM_TEXT_MAX],
        },
        use_bin_type=True,
    )
    return spans


def decode_platform(spans: bytes) -> NodePlatform | None:
    """The platform a TELEMETRY's ``spans`` carries; None for anything else (other telemetry,
    a malformed map, texts too long)."""
    try:
        value = msgpack.unpackb(spans, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException):
        return None
    if not isinstance(value, dict) or set(value) != {"cpu", "engine"}:
        return None
    cpu, engine = value["cpu"], value["engine"]
    if not (isinstance(cpu, str) and isinstance(engine, str)):
        return None
    if max(len(cpu), len(engine)) > PLATFORM_TEXT_MAX:
        return None
    return NodePlatform(cpu, engine)


__all__ = ["PLATFORM_TEXT_MAX", "NodePlatform", "decode_platform", "encode_platform"]
