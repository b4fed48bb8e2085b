"""A model's weights gathered for :class:`sfnode.engines.runners.decoder.DecoderRunner`, from
the model as stored (:class:`~sfnode.engines.weights.stored.StoredModel`: a GGUF file, a Hugging
Face folder, or a transformers model's own arrays), for every family of
:mod:`sfnode.engines.families` (docs/engine.md sections 5 and 5.4).

The runner does the model's arithmetic itself, so it wants the weights as plain tensors and
:class:`~sfnode.engines.kernels.quant.Linear` kernels rather than modules: per layer its norms
(with, by the family, q/k norms and the norms after each half), one query/key/value projection,
the output projection, one gate/up projection and the down projection, each with its bias where
the family has one; then the final norm, the token embedding and the output head.

How a matrix is held depends on the weights mode and on how the file stores it:

- ``auto``: each matrix in the precision its file gives (Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K as
  int4; Q8_0
  and Q6_K as int8; float ones as float32, or bfloat16 for a bfloat16 model off the CPU), the
  head int4 where the file holds it as Q8_0 (its best logits are computed again in float32);
- ``float32``, ``bfloat16``, ``int8``, ``int4``: every matrix so.

sfnode's kernels (the ``native`` family) multiply a Q4_0/Q4_1 matrix from its own blocks laid
out in tiles, and a Q8_0, Q5_0, Q5_1 or K-quant matrix from the file's own blocks as stored
(never inflated); torch's kernels take Q4_0/Q4_1 blocks as int4 groups exactly and quantize
anything else again for their int4 and int8 kernels.  A projection whose parts are stored in
different formats keeps each part's own kernel.

Packing a model takes seconds, so what was converted for a GGUF file's kernels is kept beside its
files (:mod:`sfnode.engines.weights.packed`) and read back on later starts.

This module must never change the model it reads, and never keep a weight in a form the
self-check of :mod:`sfnode.engines.kernels.quant` did not pass: a failed kernel falls back to
float, with one log line that says why.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from twisted.logger import Logger

from sfnode.engines import WEIGHT_MODES
from sfnode.engines.families.spec import ModelSpec
from sfnode.engines.kernels import native
from sfnode.engines.kernels.blocks import K_QUANTS
from sfnode.engines.kernels.choice import FAMILIES, Choice, Cpu, Measure, choose, measure_product
from sfnode.engines.kernels.maps import give_back, resident_bytes
from sfnode.engines.kernels.quant import (
    GgufMatrix,
    JoinedLinear,
    Linear,
    Precision,
    Projection,
    StoredRows,
    dense_rows,
    from_gguf,
    onednn_works,
    quantize,
)
from sfnode.engines.weights import packed
from sfnode.engines.weights.stored import StoredModel, StoredTensor, read_arrays

log = Logger(namespace="sfnode.engines.weights")

PROJECTIONS = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}
"""Each projection a layer multiplies by, and the stored matrices it is made of."""
_PRECISION_OF_KIND = {
    "Q4_0": Precision.INT4,
    "Q4_1": Precision.INT4,
    "Q5_0": Precision.INT4,
    "Q5_1": Precision.INT4,
    "Q4_K": Precision.INT4,
    "Q5_K": Precision.INT4,
    "Q8_0": Precision.INT8,
    "Q6_K": Precision.INT8,
}
"""What ``auto`` makes of each quantized format."""
CHOICE_FILE = "kernel-choice.json"
"""The kernel choices kept beside the packed weights (:mod:`sfnode.engines.kernels.choice`)."""


class WeightsError(Exception):
    """The weights cannot be served in the mode asked for; the message says why."""


@dataclass
class LayerWeights:
    """One decoder layer: norms as float tensors, projections as kernels; what the family has
    not is None."""

    attn_norm: torch.Tensor
    qkv: Projection
    o: Projection
    mlp_norm: torch.Tensor
    gate_up: Projection
    down: Projection
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    attn_post_norm: torch.Tensor | None = None
    mlp_post_norm: torch.Tensor | None = None


@dataclass
class ModelWeights:
    """Everything a step reads, in the dtypes the runner computes in, and the spec that says
    how (docs/engine.md section 5.4)."""

    spec: ModelSpec
    mode: str
    """The weights mode after ``auto`` was resolved (``int4`` when any matrix is int4)."""
    activations: torch.dtype
    embed: torch.Tensor | StoredRows
    """The token embedding: a tensor in ``activations``, or the file's rows read a row at a
    time (float32 activations only)."""
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: Linear
    lm_head_float: torch.Tensor | StoredRows | None
    """The output head's float32 rows (as the file means them) when the head is quantized:
    the best logits of each row are computed again from them."""
    final_norm_float: torch.Tensor
    dense_rows: int | None = None
    """Prompt chunks of at least this many rows use the projections' dense copies (None: no
    copies; decode rows always use the kernels)."""
    family: Choice | None = None
    """The kernel family of the quantized matrices and why it was chosen."""
    kv_dtype: torch.dtype | None = None
    """How keys and values are stored (None: in :attr:`activations`)."""

    @property
    def eps(self) -> float:
        return self.spec.norm_eps

    @property
    def heads(self) -> int:
        return self.spec.heads

    @property
    def kv_heads(self) -> int:
        return self.spec.kv_heads

    @property
    def head_dim(self) -> int:
        return self.spec.head_dim

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    @property
    def hidden(self) -> int:
        return self.spec.hidden

    @property
    def intermediate(self) -> int:
        return self.spec.intermediate

    def kernels(self) -> list[Linear]:
        """Every kernel the projections and the head multiply with (a joined projection's
        parts one by one)."""
        found: list[Linear] = []
        for block in self.layers:
            for projection in (block.qkv, block.o, block.gate_up, block.down):
                kernel = projection.kernel
                found += kernel.parts if isinstance(kernel, JoinedLinear) else [kernel]
        return [*found, self.lm_head]

    def describe(self) -> str:
        """A short account of the kernels, for the log: ``int4 x 120, int8 x 1``, or the
        formats a kernel multiplies as stored (``Q4_K x 12, Q6_K x 3``)."""
        counts = Counter(getattr(k, "label", k.precision.value) for k in self.kernels())
        return ", ".join(f"{name} x {n}" for name, n in sorted(counts.items()))

    def row_tables(self) -> list[StoredRows]:
        """The tables read only a row at a time (the embedding, the head's float rows; one
        table where they are the same rows): the steps read them from the file with ``pread``
        (:class:`~sfnode.engines.kernels.maps.RowFile`), never needing their map's pages
        resident.  Not a table whose map the head's kernel multiplies whole at every step (a
        head kept as stored, e.g. a Q4_K_M file's Q6_K head): all of its pages are read each
        token, through the map, and giving them back would fault the whole head in again."""
        whole = self.lm_head.held if isinstance(self.lm_head, native.BlockLinear) else None
        found: dict[int, StoredRows] = {}
        for table in (self.embed, self.lm_head_float):
            if not isinstance(table, StoredRows):
                continue
            if whole is not None and np.may_share_memory(table.data, whole):
                continue
            found.setdefault(table.data.ctypes.data, table)
        return list(found.values())

    def give_back_rows(self) -> None:
        """Give back the row tables' pages of the file's map that a read through the map left
        resident (a check reading them; a table without its file), neighbours mapped with
        them (docs/engine.md section 5.3)."""
        for table in self.row_tables():
            give_back(table.data)

    def resident_bytes(self) -> int:
        """:meth:`held_bytes` less the row tables' pages not resident now."""
        missing = sum(max(0, t.nbytes - resident_bytes(t.data)) for t in self.row_tables())
        return self.held_bytes() - missing

    def held_bytes(self) -> int:
        """Bytes of the weights the step reads: every kernel's matrices, the embedding and
        the head's float rows, the norms and biases (the file's maps counted whole)."""
        tensors: dict[int, int] = {}

        def count(value: Any) -> None:
            if isinstance(value, torch.Tensor):
                tensors[value.data_ptr()] = value.numel() * value.element_size()
            elif isinstance(value, StoredRows):
                tensors[value.data.ctypes.data] = value.nbytes
            elif value is not None:
                for tensor in value.state().values() if packed.keepable(value) else ():
                    count(tensor)
                held = getattr(value, "held", None)
                if held is not None:
                    tensors[held.ctypes.data] = int(held.nbytes)

        for kernel in self.kernels():
            count(kernel)
        for value in (self.embed, self.lm_head_float, self.final_norm):
            count(value)
        for block in self.layers:
            for value in vars(block).values():
                count(value.bias if isinstance(value, Projection) else value)
        return sum(tensors.values())


# -- reading --------------------------------------------------------------------------------------


def as_stored(source: Any) -> StoredModel:
    """``source`` as a :class:`StoredModel`: itself, or a transformers model's configuration and
    float arrays (shared with the model where they are float32)."""
    if isinstance(source, StoredModel):
        return source
    generation = getattr(source, "generation_config", None)
    arrays = (
        (name, tensor.detach().to(device="cpu", dtype=torch.float32).numpy())
        for name, tensor in source.state_dict().items()
    )
    return read_arrays(
        source.config.to_dict(),
        generation.to_dict() if generation is not None else None,
        arrays,
        Path(getattr(source.config, "name_or_path", "") or "model"),
    )


def float_weight(tensor: StoredTensor) -> torch.Tensor:
    """The float32 values of ``tensor`` (a view of the file's bytes where it is F32)."""
    return torch.from_numpy(tensor.values())


def _head_tensor(stored: StoredModel) -> StoredTensor:
    """The output head: its own matrix, or the embedding when the model ties them."""
    return stored.tensors.get("lm_head") or stored.tensors["embed"]


def part_names(stored: StoredModel) -> list[str]:
    """Every matrix a projection is made of (``"{layer}.{part}"``), then ``lm_head``."""
    return [
        f"{index}.{part}"
        for index in range(stored.spec.layers)
        for parts in PROJECTIONS.values()
        for part in parts
    ] + ["lm_head"]


# -- precisions --------------------------------------------------------------------------------


def _part_precision(kind: str, mode: str, float_precision: Precision) -> Precision:
    if mode != "auto":
        return Precision(mode)
    return _PRECISION_OF_KIND.get(kind, float_precision)


def wanted_precisions(
    stored: StoredModel, mode: str, float_precision: Precision = Precision.FLOAT32
) -> dict[str, Precision]:
    """The precision ``mode`` asks for, per matrix (:func:`part_names`)."""
    tensors = stored.tensors
    wanted = {
        name: _part_precision(tensors[name].kind, mode, float_precision)
        for name in part_names(stored)[:-1]
    }
    head = _head_tensor(stored)
    wanted["lm_head"] = _part_precision(head.kind, mode, float_precision)
    if mode == "auto" and head.kind == "Q8_0":
        # The head's best logits are computed again in float32 (the runner's _logits), which
        # makes an int4 head as good as an int8 one here (perplexity within 1%), at half the
        # time: torch's int8 kernel multiplies the head 2.3 times slower than its int4 kernel.
        wanted["lm_head"] = Precision.INT4
    return wanted


def _fallback(wanted: Precision, checks: dict[Precision, str | None]) -> Precision:
    """``wanted`` if its kernel works, else bfloat16 if that works, else float32."""
    if checks.get(wanted) is None:
        return wanted
    for other in (Precision.BFLOAT16, Precision.FLOAT32):
        if checks.get(other) is None:
            return other
    return Precision.FLOAT32


def _torch_chosen(
    wanted: dict[str, Precision], checks: dict[Precision, str | None]
) -> dict[str, Precision]:
    """What torch's kernels serve: each wanted precision or its fallback, and float32 parts
    as bfloat16 beside quantized ones (the activations of the whole step are bfloat16)."""
    chosen = {name: _fallback(p, checks) for name, p in wanted.items()}
    if any(p in (Precision.INT4, Precision.INT8) for p in chosen.values()):
        chosen = {
            name: Precision.BFLOAT16 if p is Precision.FLOAT32 else p for name, p in chosen.items()
        }
    return chosen


# -- gathering ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelOptions:
    """How :func:`gather_weights` chooses and keeps kernels (see its docstring)."""

    cache_file: Path | None = None
    checks: dict[Precision, str | None] | None = None
    dense_copies: bool = True
    kernels: str = "auto"
    cpu: Cpu | None = None
    measure: Measure = measure_product
    library_dir: Path | None = None
    fused_step: bool = True


def gather_weights(
    source: Any,
    mode: str,
    *,
    float_dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    **options: Any,
) -> ModelWeights:
    """The weights of ``source`` (a :class:`StoredModel`, or a transformers model) for
    ``mode`` (see the module docstring).

    Keyword options (:class:`KernelOptions`): ``cache_file`` where converted weights are kept
    between starts (the kernel choice and the self-checks are kept in its folder, the native
    library once for the whole cache, in its ``kernels`` folder); ``checks`` overrides the
    kernel self-checks (tests use it to simulate a CPU without a kernel); ``dense_copies`` lets
    long prompt chunks use bfloat16 copies of quantized weights where that is measured to be
    faster; ``kernels`` is the family of the kernels (:mod:`sfnode.engines.kernels.choice`):
    ``auto`` measures on ``cpu`` (this one by default) with ``measure``, ``torch`` or
    ``native`` forces one; ``library_dir`` is where the native kernels are built (by default
    the cache's ``kernels`` folder); ``fused_step`` says whether the runner
    will run the whole step natively (it counts in the measurement).  ``float_dtype`` is what
    ``auto`` makes of float matrices off the CPU (bfloat16 there for a bfloat16 model).
    """
    kept = KernelOptions(**options)
    stored = as_stored(source)
    device = device or torch.device("cpu")
    _check_mode(mode, device)
    checks = kept.checks
    if checks is None:
        checks = packed.cached_precisions(kept.cache_file.parent if kept.cache_file else None)
    float_precision = Precision.FLOAT32
    if device.type != "cpu" or float_dtype != torch.float32:
        float_precision = Precision.BFLOAT16
    wanted = wanted_precisions(stored, mode, float_precision)
    family = _choose_family(stored, wanted, mode, device, kept)
    chosen = dict(wanted) if family.family == "native" else _torch_chosen(wanted, checks)
    linears = _kept_or_built(stored, wanted, chosen, family, checks, mode, kept.cache_file)
    _warn_fallbacks(wanted, family, checks)
    return _assemble(stored, mode, chosen, linears, family, kept.dense_copies, device)


def _check_mode(mode: str, device: torch.device) -> None:
    """A :class:`WeightsError` for a mode that does not exist, or that ``device`` cannot run."""
    if mode not in WEIGHT_MODES:
        raise WeightsError(
            f"unknown weights mode {mode!r}; expected one of {', '.join(WEIGHT_MODES)}"
        )
    if device.type != "cpu" and mode in ("int4", "int8"):
        raise WeightsError(f"--weights {mode} needs the CPU kernels; use bfloat16 on {device}")


def _kept_or_built(
    stored: StoredModel,
    wanted: dict[str, Precision],
    chosen: dict[str, Precision],
    family: Choice,
    checks: dict[Precision, str | None],
    mode: str,
    cache_file: Path | None,
) -> dict[str, Linear]:
    """Every projection's kernel (``"{layer}.{projection}"`` and ``lm_head``): the converted
    ones read back from ``cache_file`` where they were kept for the same signature, the rest
    built now; what was converted is kept there for the next start."""
    expected, cache_file = packed.signature(mode, checks, family, cache_file)
    cached = packed.load(cache_file, wanted, expected, family.library) or {}
    started = time.monotonic()
    builder = _Builder(stored, chosen, family)
    linears = {name: cached.get(name) or builder.build(name) for name in builder.names()}
    if builder.built:
        log.info("packed the weights in {s:.1f} s", s=time.monotonic() - started)
    converted = [name for name in builder.built if packed.keepable(linears[name])]
    if cache_file is not None and converted:
        packed.save(cache_file, expected, wanted, linears)
    return linears


class _Builder:
    """Builds each projection's kernel from the stored matrices, with the chosen family."""

    def __init__(self, stored: StoredModel, chosen: dict[str, Precision], family: Choice) -> None:
        self.stored = stored
        self.chosen = chosen
        self.library = family.library if family.family == "native" else None
        self.onednn = onednn_works()
        self.built: list[str] = []

    def names(self) -> list[str]:
        return [
            f"{index}.{short}" for index in range(self.stored.spec.layers) for short in PROJECTIONS
        ] + ["lm_head"]

    def build(self, name: str) -> Linear:
        """The kernel of projection ``name``: one kernel for all its matrices where one holds
        them, else each matrix's own (side by side: sfnode's in one call).  A kernel converted
        from the file's matrices holds copies of them: the map's pages that converting read are
        given back (they would stay resident beside the copy until the process ends)."""
        self.built.append(name)
        if name == "lm_head":
            parts = [("lm_head", _head_tensor(self.stored))]
        else:
            index, short = name.split(".")
            parts = [
                (f"{index}.{p}", self.stored.tensors[f"{index}.{p}"]) for p in PROJECTIONS[short]
            ]
        kernel = self._kernel(parts)
        if packed.keepable(kernel):
            for _, tensor in parts:
                give_back(tensor.data)
        return kernel

    def _kernel(self, parts: list[tuple[str, StoredTensor]]) -> Linear:
        precisions = {self.chosen[part] for part, _ in parts}
        tensors = [tensor for _, tensor in parts]
        if len(precisions) == 1:
            joined = self._joined(tensors, precisions.pop())
            if joined is not None:
                return joined
        kernels = [self._one(tensor, self.chosen[part]) for part, tensor in parts]
        if self.library is not None:
            return native.NativeParts(kernels, self.library)
        return JoinedLinear(kernels)

    def _joined(self, tensors: list[StoredTensor], precision: Precision) -> Linear | None:
        """One kernel for all ``tensors`` stacked along their rows, where one holds them:
        4-bit blocks as int4 (sfnode's tiles, torch's groups), float ones joined for torch's
        kernels; None where each keeps its own."""
        kinds = {t.kind for t in tensors}
        if precision is Precision.INT4 and kinds <= {"Q4_0", "Q4_1"}:
            matrices = [GgufMatrix(t.kind, t.rows, t.cols, t.data) for t in tensors]
            if self.library is not None:
                return native.Q4Linear(native.gguf_blocks(matrices), tensors[0].cols, self.library)
            return from_gguf(matrices, precision)
        if len(tensors) == 1:
            return self._one(tensors[0], precision)
        if any(self._as_stored(t, precision) for t in tensors):
            return None
        weight = torch.cat([float_weight(t) for t in tensors])
        return self._float_kernel(weight, precision)

    def _as_stored(self, tensor: StoredTensor, precision: Precision) -> bool:
        """Whether sfnode's kernels multiply ``tensor`` as the file stores it: its format's
        own precision, a format they read (it keeps its own kernel, reading the file)."""
        return (
            self.library is not None
            and tensor.kind in native.STORED_KINDS
            and _PRECISION_OF_KIND.get(tensor.kind) is precision
        )

    def _one(self, tensor: StoredTensor, precision: Precision) -> Linear:
        """The kernel of one stored matrix: sfnode's reads Q8_0 and K-quant blocks as stored
        where the precision is the format's own (in tiles, but for the head: its float rows
        for the refined logits, and a tied table's rows, are read from the same map, beside
        which tiles would be a second copy)."""
        if precision is Precision.INT4 and tensor.kind in ("Q4_0", "Q4_1"):
            joined = self._joined([tensor], precision)
            assert joined is not None
            return joined
        if self.library is not None and self._as_stored(tensor, precision):
            head = tensor is _head_tensor(self.stored)
            return native.BlockLinear(
                tensor.kind, tensor.data, tensor.cols, self.library, tiled=not head
            )
        return self._float_kernel(float_weight(tensor), precision)

    def _float_kernel(self, weight: torch.Tensor, precision: Precision) -> Linear:
        if self.library is not None and precision in (
            Precision.INT4,
            Precision.INT8,
            Precision.FLOAT32,
        ):
            from sfnode.engines.kernels.choice import family_layer

            return family_layer("native", weight, precision, self.library)
        return quantize(weight, precision, onednn=self.onednn)


def _warn_fallbacks(
    wanted: dict[str, Precision], family: Choice, checks: dict[Precision, str | None]
) -> None:
    """One line per precision asked for whose torch kernel failed its self-check."""
    for precision in sorted(set(wanted.values()), key=lambda p: p.value):
        reason = checks.get(precision) if family.family == "torch" else None
        if reason is not None:
            log.warn(
                "the {precision} kernel is not usable on this machine ({reason}); serving those "
                "weights as {fallback}",
                precision=precision.value,
                reason=reason,
                fallback=_fallback(precision, checks).value,
            )


# -- assembling ---------------------------------------------------------------------------------


def _assemble(
    stored: StoredModel,
    mode: str,
    chosen: dict[str, Precision],
    linears: dict[str, Linear],
    family: Choice,
    dense_copies: bool,
    device: torch.device,
) -> ModelWeights:
    """The weights the runner reads, in the activation type the family computes in."""
    quantized = any(p in (Precision.INT4, Precision.INT8) for p in chosen.values())
    activations = torch.float32
    if family.family == "torch" and (quantized or Precision.BFLOAT16 in chosen.values()):
        activations = torch.bfloat16
    embed, head_float = _embedding_and_head(stored, linears["lm_head"], activations, device)
    projections = {
        name: Projection(linear, bias=_bias(stored, name, activations, device))
        for name, linear in linears.items()
        if name != "lm_head"
    }
    threshold = None
    if dense_copies and family.family == "torch" and quantized:
        projections, threshold = _with_dense_copies(projections)
    served = sorted({p.value for p in chosen.values()}, key=WEIGHT_MODES.index)
    final_norm = _vector(stored, "final_norm", torch.float32, device)
    return ModelWeights(
        spec=stored.spec,
        mode=served[-1] if mode == "auto" else mode,
        activations=activations,
        embed=embed,
        layers=_layers(stored, projections, activations, device),
        final_norm=final_norm.to(activations),
        lm_head=linears["lm_head"],
        lm_head_float=head_float,
        final_norm_float=final_norm,
        dense_rows=threshold,
        family=family,
        # Half the memory of float32 keys and values, rounded as llama.cpp rounds its own; the
        # float32 mode keeps its exact path.
        kv_dtype=torch.float16 if family.family == "native" and quantized else None,
    )


def _vector(
    stored: StoredModel, name: str, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    return float_weight(stored.tensors[name]).to(device=device, dtype=dtype)


def _bias(
    stored: StoredModel, name: str, dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    """The bias of projection ``name`` (its parts' biases joined), or None."""
    index, short = name.split(".")
    parts = [stored.tensors.get(f"{index}.{part}_bias") for part in PROJECTIONS[short]]
    if all(b is None for b in parts):
        return None
    joined = [
        float_weight(b)
        if b is not None
        else torch.zeros(stored.tensors[f"{index}.{part}"].rows, dtype=torch.float32)
        for b, part in zip(parts, PROJECTIONS[short], strict=True)
    ]
    return torch.cat(joined).to(device=device, dtype=dtype)


def _layers(
    stored: StoredModel,
    projections: dict[str, Projection],
    activations: torch.dtype,
    device: torch.device,
) -> list[LayerWeights]:
    """Each decoder layer's norms (in ``activations``) and projections."""

    def norm(index: int, part: str) -> torch.Tensor | None:
        name = f"{index}.{part}"
        if name not in stored.tensors:
            return None
        return _vector(stored, name, activations, device)

    layers = []
    for index in range(stored.spec.layers):
        attn_norm, mlp_norm = norm(index, "attn_norm"), norm(index, "mlp_norm")
        assert attn_norm is not None and mlp_norm is not None
        layers.append(
            LayerWeights(
                attn_norm=attn_norm,
                qkv=projections[f"{index}.qkv"],
                o=projections[f"{index}.o"],
                mlp_norm=mlp_norm,
                gate_up=projections[f"{index}.gate_up"],
                down=projections[f"{index}.down"],
                q_norm=norm(index, "q_norm"),
                k_norm=norm(index, "k_norm"),
                attn_post_norm=norm(index, "attn_post_norm"),
                mlp_post_norm=norm(index, "mlp_post_norm"),
            )
        )
    return layers


def _rows_table(tensor: StoredTensor) -> torch.Tensor | StoredRows:
    """A table of float32 rows: the file's F32 rows as they are, any other format read a row
    at a time."""
    if tensor.kind == "F32":
        return float_weight(tensor)
    return StoredRows(tensor.kind, tensor.data, tensor.cols)


def _embedding_and_head(
    stored: StoredModel, lm_head: Linear, activations: torch.dtype, device: torch.device
) -> tuple[torch.Tensor | StoredRows, torch.Tensor | StoredRows | None]:
    """The token embedding, and the head's float rows where the head is quantized; with
    float32 activations on the CPU both stay in the file's format, read a row at a time (bit
    for bit the rows the file means; the head's rows are the embedding's when the model ties
    them)."""
    embed_tensor = stored.tensors["embed"]
    embed: torch.Tensor | StoredRows
    if activations == torch.float32 and device.type == "cpu":
        embed = _rows_table(embed_tensor)
    else:
        embed = float_weight(embed_tensor).to(device=device, dtype=activations)
    if lm_head.precision is Precision.FLOAT32:
        return embed, None
    head = _head_tensor(stored)
    if head is embed_tensor and isinstance(embed, StoredRows | torch.Tensor):
        if embed.dtype == torch.float32:
            return embed, embed
    return embed, _rows_table(head)


def _with_dense_copies(
    projections: dict[str, Projection],
) -> tuple[dict[str, Projection], int | None]:
    """The projections with bfloat16 copies of their quantized weights, and the prompt chunk
    size from which the copies are faster (measured on layer 0; None: never, no copies)."""
    threshold = dense_rows(projections["0.gate_up"].with_dense())
    if threshold is None:
        return projections, None
    log.info(
        "prompt chunks of {rows} tokens or more multiply by bfloat16 copies of the "
        "quantized weights (faster here from that size; measured at start)",
        rows=threshold,
    )
    return {name: p.with_dense() for name, p in projections.items()}, threshold


# -- choosing kernels --------------------------------------------------------------------------


def _choose_family(
    stored: StoredModel,
    wanted: dict[str, Precision],
    mode: str,
    device: torch.device,
    kept: KernelOptions,
) -> Choice:
    """The kernel family of the mode's matrices (:mod:`sfnode.engines.kernels.choice`), logged."""
    precisions = set(wanted.values())
    quantized = precisions & {Precision.INT4, Precision.INT8}
    all_float32 = precisions == {Precision.FLOAT32}
    if device.type != "cpu" or not (quantized or all_float32):
        return Choice("torch", "only torch's kernels serve these weights", all_float32=all_float32)
    if kept.kernels not in ("auto", *FAMILIES):
        raise WeightsError(f"kernels must be auto, {' or '.join(FAMILIES)}, not {kept.kernels!r}")
    cpu = kept.cpu or Cpu.here()
    library_dir = kept.library_dir or _library_dir(kept.cache_file)
    k_quants = sorted({t.kind for t in stored.tensors.values()} & (K_QUANTS | {"Q5_0", "Q5_1"}))
    if kept.kernels == "torch":
        choice = Choice("torch", "asked for", all_float32=all_float32)
        if k_quants:
            log.warn(
                "torch's kernels multiply no {kinds} blocks: those matrices are quantized again "
                "for them (a second rounding); sfnode's kernels multiply them as stored",
                kinds=", ".join(k_quants),
            )
    elif kept.kernels == "native" or (k_quants and kept.kernels == "auto"):
        loaded = native.load(library_dir, cpu.flags)
        if isinstance(loaded, str) and kept.kernels == "auto":
            choice = Choice("torch", f"sfnode's kernels are not available ({loaded})")
        elif isinstance(loaded, str):
            raise WeightsError(f"sfnode's native kernels cannot be used here: {loaded}")
        else:
            why = (
                "asked for"
                if kept.kernels == "native"
                else (
                    f"the file's {', '.join(k_quants)} blocks are multiplied as stored by sfnode's "
                    "kernels only"
                )
            )
            choice = Choice("native", why, library=loaded, all_float32=all_float32)
    else:
        choice = choose(
            _layer0_samples(stored, wanted, all_float32),
            cpu=cpu,
            library_dir=library_dir,
            cache_file=(kept.cache_file.parent / CHOICE_FILE) if kept.cache_file else None,
            measure=kept.measure,
            native_fused=kept.fused_step,
        )
    _log_choice(choice, mode, cpu)
    return choice


def _layer0_samples(
    stored: StoredModel, wanted: dict[str, Precision], all_float32: bool
) -> dict[str, tuple[torch.Tensor, Precision]]:
    """Layer 0's projections the family is measured on, as float weights and the precision the
    mode wants for each (the embedding when none is measured)."""
    measured = (Precision.INT4, Precision.INT8, Precision.FLOAT32)
    samples: dict[str, tuple[torch.Tensor, Precision]] = {}
    for short, parts in PROJECTIONS.items():
        precision = wanted[f"0.{parts[0]}"]
        if precision in measured and (precision is not Precision.FLOAT32 or all_float32):
            weight = torch.cat([float_weight(stored.tensors[f"0.{p}"]) for p in parts])
            samples[short] = (weight, precision)
    if not samples:
        samples["lm_head"] = (float_weight(stored.tensors["embed"]), wanted["lm_head"])
    return samples


def _log_choice(choice: Choice, mode: str, cpu: Cpu) -> None:
    if choice.library is not None and choice.library.built_seconds:
        log.info(
            "built sfnode's native kernels in {s:.1f} s (once; kept in {path})",
            s=choice.library.built_seconds,
            path=str(choice.library.path),
        )
    log.info(
        "the matrices of --weights {mode} multiply with the {family} kernels "
        "({activations} activations): {why}; CPU: {cpu}",
        mode=mode,
        family=choice.family,
        activations=str(choice.activations).removeprefix("torch."),
        why=choice.why,
        cpu=cpu.describe(),
    )


def _default_library_dir() -> Path:
    from sfnode.engines.weights.loading import default_cache_dir

    return default_cache_dir().parent / "kernels"


def _library_dir(cache_file: Path | None) -> Path:
    """Where the native library is built and kept: one for every model of a cache (its name
    is the source's hash), never one per model (each GGUF file would compile it again)."""
    from sfnode.engines.weights.loading import default_cache_dir

    root = cache_file.parent.parent if cache_file is not None else None
    if root is None or root == default_cache_dir():
        return _default_library_dir()
    return root / "kernels"


__all__ = [
    "CHOICE_FILE",
    "PROJECTIONS",
    "LayerWeights",
    "ModelWeights",
    "WeightsError",
    "as_stored",
    "float_weight",
    "gather_weights",
    "wanted_precisions",
]
