"""Which kernels, and so which activation type, a weights mode uses on this CPU: found out at
start by timing the candidates on one layer of the model, and kept beside the packed weights,
keyed by the CPU's flags (docs/engine.md section 5.1).

Two families of kernels multiply the weights:

- ``torch``: torch's own kernels: ``_weight_int4pack_mm_for_cpu`` and ``_weight_int8pack_mm``,
  which want bfloat16 activations (fast where the CPU computes in bfloat16: AVX512-BF16, AMX;
  slow where bfloat16 is emulated), and oneDNN's float32 matmul;
- ``native``: sfnode's AVX2 kernels (:mod:`sfnode.engines.kernels.native`) for int4, int8 and
float32
  weights, float32 activations (quantized per row and block of 32 inside the int kernels); they
  need AVX2, FMA, F16C, and a C compiler at the first start or the build a wheel ships.

The quantized kernels of both are batch-invariant.  The family decides the activation type of
the whole step (norms, attention, KV): a mode's matrices must agree on it.  :func:`choose` runs
each available family's kernels on layer 0's own weights at one and at eight rows, drops a
family whose answer is not the float reference's (its self-check), and keeps the fastest; the
choice and the figures go to the log and to a small JSON file, so a restart on the same CPU
reads it instead of measuring again.

This module must never keep a family that failed its check, never reuse a choice measured on a
CPU with other flags, and never touch the model object (it gets plain tensors).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from twisted.logger import Logger

from sfnode.engines.kernels import native
from sfnode.engines.kernels.quant import (
    Float32Linear,
    Int4Linear,
    Int8Linear,
    Linear,
    Precision,
    int4_parts,
    onednn_works,
)
from sfnode.linkf.atomic_files import write_json

log = Logger(namespace="sfnode.engines.kernels.choice")

FAMILIES = ("torch", "native")
EXTENSIONS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)
"""The vector extensions that matter to these kernels, as /proc/cpuinfo names them."""

ROWS = (1, 8)
"""Row counts the candidates are timed at: one decoding lane, and eight."""

_CHOICE_FORMAT = 2


@dataclass(frozen=True)
class Cpu:
    """What the CPU offers, from its flags (tests pass made-up flags)."""

    flags: frozenset[str]

    @classmethod
    def here(cls) -> Cpu:
        return cls(native.cpu_flags())

    @property
    def extensions(self) -> tuple[str, ...]:
        """The vector extensions of :data:`EXTENSIONS` this CPU has."""
        return tuple(name for name in EXTENSIONS if name in self.flags)

    def describe(self) -> str:
        """``avx2 fma f16c; no avx512f, avx512_bf16, ...`` for the log."""
        have = " ".join(self.extensions) or "none of the known vector extensions"
        lacking = [name for name in EXTENSIONS if name not in self.flags]
        return have + (f"; no {', '.join(lacking)}" if lacking else "")

    def key(self) -> str:
        """Names this CPU's kind: a hash of all its flags and torch's version."""
        text = " ".join(sorted(self.flags)) + "|" + torch.__version__
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Choice:
    """The family a mode's quantized matrices use, and why."""

    family: str
    why: str
    timings: Mapping[str, float] = field(default_factory=dict)
    """Microseconds of layer 0's products at :data:`ROWS` (summed), per family measured."""
    library: native.Library | None = None
    """The native library, when ``family`` is ``native``."""
    all_float32: bool = False
    """Whether the mode's matrices are all float32 (then torch's family computes in float32)."""

    @property
    def activations(self) -> torch.dtype:
        if self.family == "native" or self.all_float32:
            return torch.float32
        return torch.bfloat16


Measure = Callable[[Linear, torch.Tensor], float]
"""Seconds one product takes (tests replace it to play a CPU of another kind)."""


def measure_product(layer: Linear, x: torch.Tensor, repeats: int = 9) -> float:
    """The median CPU time of ``layer(x)`` on one thread over ``repeats`` runs, after a
    warm-up run.

    CPU time of one thread, not wall time: a node often starts while other work shares the
    cores, and spinning OpenMP threads then measure the machine's load rather than the kernel.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        layer(x)
        times = []
        for _ in range(repeats):
            started = time.thread_time()
            layer(x)
            times.append(time.thread_time() - started)
    finally:
        torch.set_num_threads(threads)
    return sorted(times)[repeats // 2]


def family_layer(
    family: str, weight: torch.Tensor, precision: Precision, library: native.Library | None
) -> Linear:
    """``weight`` as a :class:`Linear` of ``precision`` with ``family``'s kernel."""
    if family == "native":
        assert library is not None
        if precision is Precision.FLOAT32:
            return native.F32Linear(weight, library)
        if precision is Precision.INT4:
            return native.Q4Linear(
                native.pack_blocks(*int4_parts(weight)), weight.shape[1], library
            )
        if precision is Precision.INT8:
            reference = Int8Linear.quantize(weight)
            return native.Q8Linear(reference.weight, reference.scales.to(torch.float32), library)
        raise ValueError(f"sfnode has no {precision.value} kernel")
    if precision is Precision.FLOAT32:
        return Float32Linear(weight, onednn=onednn_works())
    if precision is Precision.INT4:
        return Int4Linear.quantize(weight)
    if precision is Precision.INT8:
        return Int8Linear.quantize(weight)
    raise ValueError(f"torch's family has no {precision.value} kernel here")


class _Glue:
    """A layer's work besides its products, as torch operators in one activation type: two RMS
    norms, the rotary embedding, one decode row's attention over 128 positions, the SiLU gate
    and two residual adds.  Part of what a family costs: where bfloat16 is emulated, this work
    is slow in bfloat16 too."""

    def __init__(self, dtype: torch.dtype, hidden: int, intermediate: int) -> None:
        self.activations = dtype
        self.in_features = hidden
        self._intermediate = intermediate
        self._weight = torch.ones(hidden, dtype=dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F  # noqa: N812

        rows, hidden = x.shape
        gate = x.new_ones((rows, 2 * self._intermediate))
        for _ in range(2):
            normed = F.rms_norm(x, (hidden,), self._weight, 1e-5)
            x = x + normed
        turned = torch.addcmul(x * x, x.roll(hidden // 2, dims=-1), x)
        heads = max(1, hidden // 64)
        query = turned[:, : heads * 64].reshape(rows, heads, 1, 64)
        keys = query.new_ones((rows, heads, 128, 64))
        attended = F.scaled_dot_product_attention(query, keys, keys).reshape(rows, -1)
        gated = F.silu(gate[:, : self._intermediate]) * gate[:, self._intermediate :]
        return attended + gated[:, : attended.shape[1]]


def _self_check(layer: Linear, weight: torch.Tensor) -> str | None:
    """None when ``layer`` computes ``x @ W^T`` for the weights it holds, else why not."""
    from sfnode.engines.kernels.quant import effective_weight

    generator = torch.Generator().manual_seed(11)
    x = torch.randn(5, layer.in_features, generator=generator)
    try:
        got = layer(x.to(layer.activations)).to(torch.float32)
    except (RuntimeError, ValueError, NotImplementedError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no message'}"
    want = x @ effective_weight(layer).t()
    scale = float(want.abs().max()) or 1.0
    error = float((got - want).abs().max()) / scale if got.shape == want.shape else float("inf")
    # Activations held in bfloat16 (8 bits of mantissa) or in int8 per block of 32 err by
    # about 1%; a wrong kernel errs by the size of the result.
    if error > 0.05:
        return f"its result differs from the float reference (error {error:.3g} of the largest)"
    return None


def choose(
    samples: Mapping[str, tuple[torch.Tensor, Precision]],
    *,
    cpu: Cpu,
    library_dir: Path,
    cache_file: Path | None = None,
    measure: Measure = measure_product,
    native_fused: bool = True,
) -> Choice:
    """The family for matrices like ``samples`` (layer 0's projections: float weights and the
    precision the mode wants for each), on ``cpu``.

    ``library_dir`` is where the native library is built and kept; ``cache_file`` where choices
    are kept, by CPU and precisions.  Each family's time is its products plus the layer's other
    work in its activation type (:class:`_Glue`), except that with ``native_fused`` the native
    family's other work runs inside its fused calls (docs/engine.md section 5.2) and costs
    nothing more.
    """
    wanted = sorted({p.value for _, p in samples.values()})
    all_float32 = wanted == [Precision.FLOAT32.value]
    key = f"{cpu.key()}|{','.join(wanted)}|{'native-step' if native_fused else 'eager'}"
    loaded = native.load(library_dir, cpu.flags)
    library = None if isinstance(loaded, str) else loaded
    cached = _read(cache_file, key)
    if cached is not None and (cached.family != "native" or library is not None):
        return Choice(
            cached.family,
            f"kept from {cache_file}",
            cached.timings,
            library if cached.family == "native" else None,
            all_float32,
        )
    families = ["torch"] + (["native"] if library is not None else [])
    timings, failed = _measure_families(
        families, samples, library, measure, native_fused=native_fused, all_float32=all_float32
    )
    if not timings:
        # Neither family works: the caller's kernel self-checks fall back to float weights.
        why = "no family passed its check: " + "; ".join(failed.values())
        return Choice("torch", why, all_float32=all_float32)
    best = min(timings, key=lambda name: timings[name])
    why = _measured_why(timings, failed, loaded)
    choice = Choice(best, why, timings, library if best == "native" else None, all_float32)
    if cache_file is not None:
        _write(cache_file, key, choice)
    return choice


def _measure_families(
    families: list[str],
    samples: Mapping[str, tuple[torch.Tensor, Precision]],
    library: native.Library | None,
    measure: Measure,
    *,
    native_fused: bool,
    all_float32: bool,
) -> tuple[dict[str, float], dict[str, str]]:
    """Each family's microseconds over the samples' products at :data:`ROWS` and the layer's
    other work (:class:`_Glue`, unless the native step runs it), and why each family that
    failed its self-check failed."""
    shapes = [weight.shape for weight, _ in samples.values()]
    hidden = int(min(shape[1] for shape in shapes))
    intermediate = int(max(max(shape) for shape in shapes)) // 2
    timings: dict[str, float] = {}
    failed: dict[str, str] = {}
    for family in families:
        total = 0.0
        for weight, precision in samples.values():
            try:
                layer = family_layer(family, weight, precision, library)
            except ValueError as e:
                failed[family] = str(e)
                break
            problem = _self_check(layer, weight)
            if problem is not None:
                failed[family] = problem
                break
            for rows in ROWS:
                x = torch.randn(rows, weight.shape[1]).to(layer.activations)
                total += measure(layer, x)
        if family not in failed:
            dtype = torch.float32 if family == "native" or all_float32 else torch.bfloat16
            glue = _Glue(dtype, hidden, intermediate)
            for rows in ROWS if family == "torch" or not native_fused else ():
                total += measure(glue, torch.randn(rows, hidden).to(dtype))  # type: ignore[arg-type]
            timings[family] = total * 1e6
    return timings, failed


def _measured_why(
    timings: Mapping[str, float], failed: Mapping[str, str], loaded: native.Library | str
) -> str:
    """The log's account of a measured choice: each family's time or failure, why the native
    family was not measured, and where its library came from."""
    parts = [f"{name} {us:.0f} us" for name, us in sorted(timings.items())]
    parts += [f"{name} failed its check ({why})" for name, why in failed.items()]
    if isinstance(loaded, str):
        parts.append(f"native not available ({loaded})")
    why = "measured layer 0's products and its other work at 1 and 8 rows: " + ", ".join(parts)
    if isinstance(loaded, native.Library) and loaded.built_seconds:
        why += f"; the native kernels compiled in {loaded.built_seconds:.1f} s"
    if isinstance(loaded, native.Library) and loaded.shipped:
        why += "; the native kernels are the build shipped with sfnode (no usable C compiler here)"
    return why


def _read(path: Path | None, key: str) -> Choice | None:
    if path is None or not path.is_file():
        return None
    try:
        entries = json.loads(path.read_text())
        entry = (
            entries.get("choices", {}).get(key) if entries.get("format") == _CHOICE_FORMAT else None
        )
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(entry, dict) or entry.get("family") not in FAMILIES:
        return None
    timings = entry.get("timings_us", {})
    return Choice(entry["family"], "cached", {k: float(v) for k, v in timings.items()})


def _write(path: Path, key: str, choice: Choice) -> None:
    try:
        entries = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        entries = {}
    if not isinstance(entries, dict) or entries.get("format") != _CHOICE_FORMAT:
        entries = {"format": _CHOICE_FORMAT, "choices": {}}
    entries.setdefault("choices", {})[key] = {
        "family": choice.family,
        "timings_us": dict(choice.timings),
        "why": choice.why,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        write_json(path, entries, indent=1)
    except OSError as e:
        log.warn("could not keep the kernel choice in {path}: {e}", path=str(path), e=e)


__all__ = ["EXTENSIONS", "FAMILIES", "Choice", "Cpu", "choose", "family_layer", "measure_product"]
