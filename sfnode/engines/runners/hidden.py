"""Hidden states between pipeline stages as the D5 blob ``[dtype, [n_tokens, hidden_size], bin]``
(docs/protocol.md, STAGE_FORWARD).

This module must never accept a blob it cannot account for byte by byte: anything malformed is a
:class:`~sfnode.generation.StageForwardError` with the reason.
"""

from __future__ import annotations

import msgpack
import torch

from sfnode.generation import StageForwardError

_BLOB_DTYPES: dict[str, torch.dtype] = {
    "f32": torch.float32,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
}
_DTYPE_NAMES = {v: k for k, v in _BLOB_DTYPES.items()}
_ITEM_SIZES = {
    dtype: torch.empty((), dtype=dtype).element_size() for dtype in _BLOB_DTYPES.values()
}
"""Bytes per element of each blob dtype, found once (a blob is decoded at every stage hop)."""


def encode_hidden(hidden: torch.Tensor) -> bytes:
    """A ``[n_tokens, hidden_size]`` tensor as the blob (dtypes other than f32/f16/bf16 as f32)."""
    name = _DTYPE_NAMES.get(hidden.dtype)
    if name is None:
        hidden = hidden.to(torch.float32)
        name = "f32"
    n, h = hidden.shape
    raw = hidden.contiguous().cpu().view(torch.uint8).numpy().tobytes()
    packed: bytes = msgpack.packb([name, [int(n), int(h)], raw], use_bin_type=True)
    return packed


def decode_hidden(blob: bytes, hidden_size: int) -> torch.Tensor:
    """The tensor of a blob; :class:`StageForwardError` for anything malformed."""
    try:
        value = msgpack.unpackb(blob, raw=False)
    except Exception as e:
        raise StageForwardError(f"hidden blob is not msgpack: {e}") from e
    if not (isinstance(value, list) and len(value) == 3):
        raise StageForwardError("hidden blob must be [dtype, [n_tokens, hidden_size], bin]")
    name, shape, raw = value
    dtype = _BLOB_DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise StageForwardError(f"hidden blob dtype {name!r} is not one of f32, f16, bf16")
    if not (
        isinstance(shape, list)
        and len(shape) == 2
        and all(isinstance(d, int) and not isinstance(d, bool) for d in shape)
    ):
        raise StageForwardError("hidden blob shape must be [n_tokens, hidden_size]")
    n, h = shape
    if h != hidden_size:
        raise StageForwardError(f"hidden size {h} does not match the model's {hidden_size}")
    if n <= 0:
        raise StageForwardError(f"hidden blob holds {n} tokens")
    if not isinstance(raw, bytes):
        raise StageForwardError("hidden blob data must be bytes")
    itemsize = _ITEM_SIZES[dtype]
    if len(raw) != n * h * itemsize:
        raise StageForwardError(
            f"hidden blob holds {len(raw)} bytes, expected {n * h * itemsize} for {n}x{h} {name}"
        )
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(n, h)
