"""Linear layers in the precision a model's weights actually have: float32, bfloat16, int8, int4.

A GGUF file stores most of a model's matrices in small blocks: Q4_0 and Q4_1 hold 32 weights in 4
bits each with a float16 scale ``d`` (and for Q4_1 a minimum ``m``): ``w = d*q + m`` (Q4_0:
``w = d*(q - 8)``); Q8_0 holds 32 int8 weights with a scale.  Inflating them to float32 reads four
to eight times more memory per decode step than the file holds, and a decode step on a CPU is
bound by how fast it reads the weights.

This module turns a weight matrix into a :class:`Linear`, a callable ``y = x @ W^T`` with one of
these kernels (all PyTorch's own operators; docs/engine.md section 5 has the measurements):

- ``float32``: oneDNN's matmul (``torch.ops.mkldnn._linear_pointwise``) or ``F.linear``;
- ``bfloat16``: ``F.linear`` on bfloat16 weights (oneDNN, AVX512-BF16 where the CPU has it);
- ``int8``: ``torch.ops.aten._weight_int8pack_mm``: int8 weights with one scale per output row;
- ``int4``: ``torch.ops.aten._weight_int4pack_mm_for_cpu``: 4-bit weights in groups of 32 along
  the input dimension, each group with a scale and a zero, ``w = (q - 8) * scale + zero``.  A Q4_1
  block maps onto one group exactly (``scale = d``, ``zero = m + 8d``), so the bundled model's own
  4-bit weights are served as they are, rounded only by holding ``d`` and ``m + 8d`` in bfloat16.

The quantized kernels take bfloat16 activations (with float32 activations both take a path tens of
times slower), so a quantized model computes in bfloat16 between its matrices.  Before a kernel is
used, :func:`kernel_works` runs it once on a small problem against a float reference; a missing
operator or a wrong answer makes the caller fall back to a float kernel and say so.

This module must never touch a model object, a thread or the reactor: it turns tensors into
callables and checks kernels, nothing else.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from sfnode.engines.kernels.maps import row_file

GROUP = 32
"""Weights per quantization group (a GGUF block, and the int4 kernel's group size)."""

_CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8)
"""Fractions of a group's range tried when a float matrix is quantized to int4."""


class Precision(enum.Enum):
    """How a :class:`Linear` holds its weights."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    INT8 = "int8"
    INT4 = "int4"

    @property
    def activations(self) -> torch.dtype:
        """The dtype of what flows in and out of a layer of this precision."""
        return torch.float32 if self is Precision.FLOAT32 else torch.bfloat16


# -- GGUF blocks -------------------------------------------------------------------------------


@dataclass(frozen=True)
class GgufMatrix:
    """A quantized matrix as a GGUF file stores it: ``rows`` blocks-rows of raw bytes."""

    kind: str
    """``Q4_0``, ``Q4_1`` or ``Q8_0``."""
    rows: int
    cols: int
    data: np.ndarray[Any, np.dtype[np.uint8]]
    """``[rows, bytes per row]``: the blocks of each row, in order along the row."""

    def take_rows(self, order: Sequence[int] | np.ndarray[Any, Any]) -> GgufMatrix:
        """The same matrix with its rows reordered (a block never spans two rows)."""
        return GgufMatrix(self.kind, self.rows, self.cols, np.ascontiguousarray(self.data[order]))


_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
GGUF_KINDS = frozenset(_BLOCK_BYTES)


def _blocks(matrix: GgufMatrix) -> np.ndarray[Any, np.dtype[np.uint8]]:
    size = _BLOCK_BYTES[matrix.kind]
    if matrix.cols % GROUP or matrix.data.shape != (matrix.rows, matrix.cols // GROUP * size):
        raise ValueError(
            f"{matrix.kind} matrix of {matrix.rows}x{matrix.cols} does not match its "
            f"{matrix.data.shape} bytes"
        )
    return matrix.data.reshape(matrix.rows, matrix.cols // GROUP, size)


def _half(raw: np.ndarray[Any, np.dtype[np.uint8]]) -> torch.Tensor:
    """Little-endian float16 from ``[..., 2]`` bytes, as float32."""
    halves = np.ascontiguousarray(raw).view("<f2")[..., 0]
    return torch.from_numpy(halves.astype(np.float32))


def q4_parts(matrix: GgufMatrix) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, scale, minimum)`` of a Q4_0/Q4_1 matrix: ``w = scale * q + minimum`` per group.

    ``q`` is ``[rows, cols]`` uint8 in 0..15; ``scale`` and ``minimum`` are ``[rows, groups]``
    float32 (exact: they are float16 in the file).  Q4_0's minimum is ``-8 * scale``.
    """
    if matrix.kind not in ("Q4_0", "Q4_1"):
        raise ValueError(f"not a 4-bit GGUF matrix: {matrix.kind}")
    blocks = _blocks(matrix)
    scale = _half(blocks[..., 0:2])
    if matrix.kind == "Q4_1":
        minimum = _half(blocks[..., 2:4])
        packed = blocks[..., 4:20]
    else:
        minimum = -8.0 * scale
        packed = blocks[..., 2:18]
    # Byte j of a block holds weight j in its low nibble and weight j + 16 in its high nibble.
    low = packed & 0x0F
    high = packed >> 4
    q = np.concatenate([low, high], axis=-1).reshape(matrix.rows, matrix.cols)
    return torch.from_numpy(np.ascontiguousarray(q)), scale, minimum


def q8_parts(matrix: GgufMatrix) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of a Q8_0 matrix: ``w = scale * q`` per group; q int8, scale float32."""
    if matrix.kind != "Q8_0":
        raise ValueError(f"not a Q8_0 GGUF matrix: {matrix.kind}")
    blocks = _blocks(matrix)
    scale = _half(blocks[..., 0:2])
    q = np.ascontiguousarray(blocks[..., 2:34]).view(np.int8).reshape(matrix.rows, matrix.cols)
    return torch.from_numpy(q.copy()), scale


def dequantize(matrix: GgufMatrix) -> torch.Tensor:
    """The float32 weights of a GGUF matrix (what the file means, before any kernel rounding)."""
    if matrix.kind == "Q8_0":
        q8, scale = q8_parts(matrix)
        grouped = q8.view(matrix.rows, -1, GROUP).to(torch.float32) * scale.unsqueeze(-1)
        return grouped.reshape(matrix.rows, matrix.cols)
    q, scale, minimum = q4_parts(matrix)
    grouped = q.view(matrix.rows, -1, GROUP).to(torch.float32) * scale.unsqueeze(-1)
    return (grouped + minimum.unsqueeze(-1)).reshape(matrix.rows, matrix.cols)


class StoredRows:
    """A table of rows (an embedding, the float rows a quantized head's best logits are
    computed again from) kept in the file's own format and read a row at a time:
    ``rows[index]`` is the float32 rows ``index`` picks (any index tensor; the last dimension
    is the row), dequantized as :func:`sfnode.engines.kernels.blocks.dequantize` does, so bit
    for bit what the file means.  A Q8_0 table costs a quarter of its float32 copy, a Q4_K one
    an eighth (docs/engine.md section 5)."""

    dtype = torch.float32

    def __init__(self, kind: str, data: np.ndarray[Any, np.dtype[np.uint8]], cols: int) -> None:
        """``data`` is ``[rows, bytes a row]`` of format ``kind`` (held, not copied)."""
        from sfnode.engines.kernels.blocks import FORMATS

        self.kind = kind
        self.ggml_type = FORMATS[kind].ggml_type
        self.data = data
        self.shape = torch.Size((int(data.shape[0]), cols))
        self.file = row_file(data)
        """The rows read from the file with ``pread`` (None: through ``data``, not a file's map):
        a read through the map would map the pages around each row read with it."""

    def __getitem__(self, index: torch.Tensor) -> torch.Tensor:
        from sfnode.engines.kernels.blocks import dequantize as dequantize_blocks

        picked = np.asarray(index.cpu()).reshape(-1)
        stored = self.data[picked] if self.file is None else self.file.read(picked)
        rows = dequantize_blocks(self.kind, stored, self.shape[1])
        return torch.from_numpy(rows).view(*index.shape, self.shape[1])

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


class JoinedLinear:
    """A projection of several parts side by side (query, key and value; gate and up) whose
    parts no one kernel holds (stored in different formats): each part's own kernel, the
    outputs joined along the row."""

    def __init__(self, parts: Sequence[Linear]) -> None:
        self.parts = list(parts)
        self.precision = max((p.precision for p in parts), key=list(Precision).index)
        self.activations = parts[0].activations
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)

    def state(self) -> dict[str, torch.Tensor]:
        raise TypeError("a joined projection is rebuilt from its parts, never kept")


# -- linear kernels ---------------------------------------------------------------------------


class Linear(Protocol):
    """``y = x @ W^T`` for ``x`` of shape ``[rows, in_features]`` in :attr:`activations`."""

    precision: Precision
    activations: torch.dtype
    """What the kernel takes and answers (a weights mode's matrices share one)."""
    in_features: int
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def state(self) -> dict[str, torch.Tensor]:
        """The tensors that rebuild this layer with :func:`linear_from_state`."""
        ...


def _onednn(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return out


class Float32Linear:
    """Float32 weights; oneDNN's matmul when it passed its check, else ``F.linear``."""

    precision = Precision.FLOAT32
    activations = torch.float32

    def __init__(self, weight: torch.Tensor, *, onednn: bool) -> None:
        self.weight = weight.to(torch.float32).contiguous()
        self.out_features, self.in_features = self.weight.shape
        self._onednn = onednn and self.weight.device.type == "cpu"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._onednn:
            return _onednn(x, self.weight)
        return torch.nn.functional.linear(x, self.weight)

    def state(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight}


class Bfloat16Linear:
    """Bfloat16 weights through ``F.linear``."""

    precision = Precision.BFLOAT16
    activations = torch.bfloat16

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.to(torch.bfloat16).contiguous()
        self.out_features, self.in_features = self.weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)

    def state(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight}


class Int8Linear:
    """Int8 weights with one bfloat16 scale per output row (``_weight_int8pack_mm``)."""

    precision = Precision.INT8
    activations = torch.bfloat16

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor) -> None:
        self.weight = weight.to(torch.int8).contiguous()
        self.scales = scales.to(torch.bfloat16).contiguous()
        self.out_features, self.in_features = self.weight.shape

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Linear:
        """Symmetric per-row int8 of a float matrix (round to nearest)."""
        w = weight.to(torch.float32)
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
        q = torch.round(w / scales.unsqueeze(1)).clamp(-127, 127).to(torch.int8)
        return cls(q, scales)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scales)
        return out

    def state(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight, "scales": self.scales}


class Int4Linear:
    """4-bit weights in groups of 32, packed for ``_weight_int4pack_mm_for_cpu``."""

    precision = Precision.INT4
    activations = torch.bfloat16

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, in_features: int) -> None:
        self.packed = packed.contiguous()
        self.scales_zeros = scales_zeros.to(torch.bfloat16).contiguous()
        self.in_features = in_features
        self.out_features = int(scales_zeros.shape[1])

    @classmethod
    def from_parts(cls, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> Int4Linear:
        """From ``w = scale * q + minimum`` per group (``q`` 0..15, ``[rows, cols]``).

        The kernel computes ``(q - 8) * scale + zero``, so ``zero = minimum + 8 * scale``.
        """
        cols = q.shape[1]
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        zero = minimum + 8.0 * scale
        scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1)  # [groups, rows, 2]
        return cls(packed, scales_zeros, cols)

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int4Linear:
        """Asymmetric group-32 int4 of a float matrix (see :func:`int4_parts`)."""
        return cls.from_parts(*int4_parts(weight))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.packed, GROUP, self.scales_zeros
        )
        return out

    def state(self) -> dict[str, torch.Tensor]:
        return {
            "packed": self.packed,
            "scales_zeros": self.scales_zeros,
            "in_features": torch.tensor(self.in_features),
        }


def int4_parts(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, scale, minimum)`` of an asymmetric group-32 int4 of a float matrix (``w = scale *
    q + minimum`` per group, q in 0..15), each group's range clipped by whichever of a few ratios
    (1.0 down to 0.8 of its width) gives the smallest squared error."""
    w = weight.to(torch.float32)
    rows, cols = w.shape
    if cols % GROUP:
        raise ValueError(f"int4 needs in_features divisible by {GROUP}, not {cols}")
    groups = w.view(rows, cols // GROUP, GROUP)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    middle, half = (low + high) / 2, (high - low) / 2
    best: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    for ratio in _CLIP_RATIOS:
        floor = middle - half * ratio
        scale = (half * ratio * 2 / 15.0).clamp(min=torch.finfo(torch.float32).tiny)
        q = torch.round((groups - floor.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp(0, 15)
        error = ((q * scale.unsqueeze(-1) + floor.unsqueeze(-1) - groups) ** 2).sum(-1)
        if best is None:
            best = (error, q, scale, floor)
            continue
        better = error < best[0]
        best = (
            torch.where(better, error, best[0]),
            torch.where(better.unsqueeze(-1), q, best[1]),
            torch.where(better, scale, best[2]),
            torch.where(better, floor, best[3]),
        )
    assert best is not None
    _, q, scale, floor = best
    return q.to(torch.uint8).view(rows, cols), scale, floor


@dataclass
class Projection:
    """One weight matrix as a runner calls it: ``kernel`` for decode rows, and for a quantized
    matrix optionally ``dense``, a bfloat16 copy of the weights the kernel multiplies by, for
    prompt chunks long enough that a dense product is faster (docs/engine.md section 5)."""

    kernel: Linear
    dense: Linear | None = None
    bias: torch.Tensor | None = None
    """Added to the product (in the activations' dtype), when the model has one."""

    @property
    def precision(self) -> Precision:
        return self.kernel.precision

    @property
    def out_features(self) -> int:
        return self.kernel.out_features

    def __call__(self, x: torch.Tensor, *, dense: bool = False) -> torch.Tensor:
        layer = self.dense if dense and self.dense is not None else self.kernel
        out = layer(x)
        return out if self.bias is None else out + self.bias

    def with_dense(self) -> Projection:
        """This projection with a dense copy (for int4 and int8 kernels; others are dense)."""
        if self.kernel.precision not in (Precision.INT4, Precision.INT8) or self.dense:
            return self
        if isinstance(self.kernel, JoinedLinear):
            return self
        weight = effective_weight(self.kernel).to(torch.bfloat16)
        return Projection(self.kernel, Bfloat16Linear(weight), self.bias)


def dense_rows(
    projection: Projection, candidates: Sequence[int] = (8, 16, 32, 64, 128), repeats: int = 5
) -> int | None:
    """The fewest rows from which ``projection``'s dense copy multiplies faster than its kernel,
    measured here (median of ``repeats``); None when it never does (the copy is then not worth
    its memory)."""
    import time

    dense = projection.dense
    if dense is None:
        return None
    for rows in candidates:
        x = torch.randn(rows, projection.kernel.in_features).to(torch.bfloat16)
        timings: dict[str, list[float]] = {"kernel": [], "dense": []}
        for _ in range(repeats):
            for name, layer in (("kernel", projection.kernel), ("dense", dense)):
                started = time.perf_counter()
                layer(x)
                timings[name].append(time.perf_counter() - started)
        kernel = sorted(timings["kernel"])[repeats // 2]
        if sorted(timings["dense"])[repeats // 2] < kernel:
            return rows
    return None


def linear_from_state(precision: Precision, state: dict[str, torch.Tensor]) -> Linear:
    """The inverse of ``Linear.state()`` (float32 layers always use ``F.linear`` here)."""
    if precision is Precision.INT4:
        return Int4Linear(state["packed"], state["scales_zeros"], int(state["in_features"].item()))
    if precision is Precision.INT8:
        return Int8Linear(state["weight"], state["scales"])
    if precision is Precision.BFLOAT16:
        return Bfloat16Linear(state["weight"])
    return Float32Linear(state["weight"], onednn=False)


def quantize(weight: torch.Tensor, precision: Precision, *, onednn: bool = False) -> Linear:
    """A float matrix as a :class:`Linear` of ``precision``."""
    if precision is Precision.INT4:
        return Int4Linear.quantize(weight)
    if precision is Precision.INT8:
        return Int8Linear.quantize(weight)
    if precision is Precision.BFLOAT16:
        return Bfloat16Linear(weight)
    return Float32Linear(weight, onednn=onednn)


def from_gguf(matrices: Sequence[GgufMatrix], precision: Precision) -> Linear:
    """GGUF matrices stacked along their rows (a fused projection) as one :class:`Linear`.

    4-bit blocks become int4 groups exactly when ``precision`` is INT4; anything else goes
    through the float weights the file means.
    """
    if precision is Precision.INT4 and all(m.kind in ("Q4_0", "Q4_1") for m in matrices):
        parts = [q4_parts(m) for m in matrices]
        return Int4Linear.from_parts(
            torch.cat([p[0] for p in parts]),
            torch.cat([p[1] for p in parts]),
            torch.cat([p[2] for p in parts]),
        )
    return quantize(torch.cat([dequantize(m) for m in matrices]), precision)


# -- self-checks --------------------------------------------------------------------------------


def onednn_works() -> bool:
    """Whether oneDNN's float32 matmul exists here and agrees with ``F.linear``."""
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 64, generator=generator)
    x = torch.randn(3, 64, generator=generator)
    try:
        got = _onednn(x, weight)
    except (AttributeError, RuntimeError):
        return False
    want = torch.nn.functional.linear(x, weight)
    return bool(got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-4))


def kernel_works(precision: Precision) -> str | None:
    """None when the kernel of ``precision`` runs here and matches a float reference, else why.

    The problem is small (a 48x64 matrix, 5 rows) so that the check costs milliseconds.
    """
    if precision is Precision.FLOAT32:
        return None
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(48, 64, generator=generator) * 0.1
    x = torch.randn(5, 64, generator=generator).to(torch.bfloat16)
    try:
        layer = quantize(weight, precision)
        got = layer(x).to(torch.float32)
    except (AttributeError, RuntimeError, NotImplementedError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no message'}"
    reference = x.to(torch.float32) @ effective_weight(layer).t()
    if got.shape != reference.shape or not torch.allclose(got, reference, rtol=2e-2, atol=2e-2):
        error = float((got - reference).abs().max()) if got.shape == reference.shape else -1.0
        return f"its result differs from the float reference (max error {error:.3g})"
    return None


def effective_weight(layer: Linear) -> torch.Tensor:
    """The float32 ``W`` a layer multiplies by, as its kernel sees it (for checks and tests)."""
    if isinstance(layer, JoinedLinear):
        return torch.cat([effective_weight(part) for part in layer.parts])
    stored = getattr(layer, "weight", None) if getattr(layer, "as_stored", False) else None
    if callable(stored):  # sfnode.engines.kernels.native.BlockLinear
        meant: torch.Tensor = stored()
        return meant
    if isinstance(layer, Int4Linear):
        # The identity times W^T is W^T: the kernel's own (q - 8) * scale + zero, rounded to
        # bfloat16 (its output dtype).
        eye = torch.eye(layer.in_features, dtype=torch.bfloat16)
        return layer(eye).to(torch.float32).t().contiguous()
    if isinstance(layer, Int8Linear):
        return layer.weight.to(torch.float32) * layer.scales.to(torch.float32).unsqueeze(1)
    if isinstance(layer, Bfloat16Linear):
        return layer.weight.to(torch.float32)
    if isinstance(layer, Float32Linear):
        return layer.weight
    blocks = getattr(layer, "blocks", None) if hasattr(layer, "tiles") else None
    if isinstance(blocks, torch.Tensor):  # sfnode.engines.kernels.native.Q4Linear
        from sfnode.engines.kernels.native import blocks_weight

        return blocks_weight(blocks, layer.in_features)
    weight, scales = getattr(layer, "weight", None), getattr(layer, "scales", None)
    if isinstance(weight, torch.Tensor) and isinstance(scales, torch.Tensor):  # native.Q8Linear
        return weight.to(torch.float32) * scales.to(torch.float32).unsqueeze(1)
    if isinstance(weight, torch.Tensor) and layer.precision is Precision.FLOAT32:  # F32Linear
        return weight
    raise TypeError(f"unknown layer {type(layer).__name__}")
