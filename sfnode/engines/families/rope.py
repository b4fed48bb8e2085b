"""The rotary embedding of a model, as one value, and its tables (docs/engine.md section 5.4).

:class:`Rope` says everything the rotation depends on: the base, how many dimensions of a head
rotate, and the scaling variant:

- ``none``: ``inv_freq[i] = 1 / base ** (2i / dims)``;
- ``linear``: every frequency divided by ``factor``;
- ``dynamic``: NTK scaling, the base grown once a sequence is longer than ``context`` (the
  table depends on the length);
- ``yarn``: frequencies blended between the plain and the interpolated ones over the
  dimensions between ``beta_fast`` and ``beta_slow`` rotations in ``original_context``, and the
  cos/sin tables multiplied by ``attention_factor``;
- ``llama3``: each frequency divided by its own factor (``freq_factors``: what a GGUF file
  holds as its ``rope_freqs`` tensor, and what Llama 3's four parameters come to).

The tables are those transformers computes (the same torch operations in the same order), so
they are equal bit for bit, except ``llama3``'s band between the low and high frequencies,
where dividing by a factor and transformers' blend may round apart by an ulp.

Torch is imported only where a table is built; the value itself is plain data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SCALINGS = ("none", "linear", "dynamic", "yarn", "llama3")


@dataclass(frozen=True)
class Rope:
    """The rotary embedding: base, rotated dimensions and scaling (see the module docstring)."""

    base: float
    dims: int
    """Dimensions of a head that rotate (the first ``dims``; the rest pass through)."""
    scaling: str = "none"
    factor: float = 1.0
    """``linear``, ``dynamic``, ``yarn``: the scaling factor."""
    original_context: int = 0
    """``yarn``: the context the model was trained with before scaling."""
    context: int = 0
    """``dynamic``: the length beyond which the base grows."""
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    """``yarn``: what the cos and sin tables are multiplied by."""
    freq_factors: tuple[float, ...] = ()
    """``llama3``: each frequency is divided by its factor (``dims / 2`` of them)."""

    def __post_init__(self) -> None:
        if self.scaling not in SCALINGS:
            raise ValueError(f"unknown rope scaling {self.scaling!r}")
        if self.scaling == "llama3" and len(self.freq_factors) != self.dims // 2:
            raise ValueError(
                f"llama3 rope needs {self.dims // 2} frequency factors, not "
                f"{len(self.freq_factors)}"
            )

    def _plain(self, base: float) -> torch.Tensor:
        import torch

        steps = torch.arange(0, self.dims, 2, dtype=torch.int64).to(dtype=torch.float)
        inverse: torch.Tensor = 1.0 / (base ** (steps / self.dims))
        return inverse

    def inv_freq(self, length: int | None = None) -> torch.Tensor:
        """The ``dims / 2`` inverse frequencies (float32); ``length`` is the sequence length a
        ``dynamic`` table is for (at least ``context``)."""
        import torch

        if self.scaling == "linear":
            return self._plain(self.base) / self.factor
        if self.scaling == "llama3":
            return self._plain(self.base) / torch.tensor(self.freq_factors, dtype=torch.float32)
        if self.scaling == "dynamic":
            seq = max(length or self.context, self.context)
            grow = (self.factor * seq / self.context) - (self.factor - 1)
            return self._plain(self.base * grow ** (self.dims / (self.dims - 2)))
        if self.scaling == "yarn":
            return self._yarn()
        return self._plain(self.base)

    def _yarn(self) -> torch.Tensor:
        import torch

        def correction(rotations: float) -> float:
            turns = self.original_context / (rotations * 2 * math.pi)
            return (self.dims * math.log(turns)) / (2 * math.log(self.base))

        low = float(max(math.floor(correction(self.beta_fast)), 0))
        high = float(min(math.ceil(correction(self.beta_slow)), self.dims - 1))
        if low == high:
            high += 0.001
        steps = torch.arange(0, self.dims, 2).to(dtype=torch.float)
        pos_freqs = self.base ** (steps / self.dims)
        extrapolation = 1.0 / pos_freqs
        interpolation = 1.0 / (self.factor * pos_freqs)
        ramp = (torch.arange(self.dims // 2, dtype=torch.float32) - low) / (high - low)
        weight = 1 - torch.clamp(ramp, 0, 1).to(dtype=torch.float)
        result: torch.Tensor = interpolation * (1 - weight) + extrapolation * weight
        return result

    def cos_sin(
        self, positions: int, length: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[positions, dims]`` float32 for positions ``0..positions-1``, in
        transformers' layout (the two halves of a head rotate together: ``rotate_half``)."""
        import torch

        inv = self.inv_freq(length)
        angles = torch.outer(torch.arange(positions, dtype=torch.float32), inv)
        table = torch.cat([angles, angles], dim=-1)
        return table.cos() * self.attention_factor, table.sin() * self.attention_factor


def yarn_attention_factor(factor: float) -> float:
    """YaRN's default multiplier of the cos and sin tables: ``0.1 ln(factor) + 1``."""
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def llama3_factors(
    dims: int, base: float, factor: float, low: float, high: float, original: int
) -> tuple[float, ...]:
    """Llama 3's rope parameters as one divisor per frequency, float32-rounded: what
    llama.cpp's converter writes as ``rope_freqs`` (1 for short wavelengths, ``factor`` for
    long ones, a smooth blend between)."""
    import torch

    freqs = 1.0 / (base ** (torch.arange(0, dims, 2, dtype=torch.float32) / dims))
    low_wavelen, high_wavelen = original / low, original / high
    factors: list[Any] = []
    # Each frequency as a float32 scalar tensor, so that every step rounds as the converter's.
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return tuple(float(f) for f in torch.tensor(factors, dtype=torch.float32).tolist())


__all__ = ["SCALINGS", "Rope", "llama3_factors", "yarn_attention_factor"]
