"""A Llama model's weights, gathered for :class:`sfnode.engines.runners.llama.LlamaRunner`.

The runner does the model's arithmetic itself, so it wants the weights as plain tensors and
:class:`~sfnode.engines.kernels.quant.Linear` kernels rather than modules: per layer the two RMSNorm
weights, one fused query/key/value projection, the output projection, one fused gate/up projection
and the down projection; then the final norm, the token embedding and the output head.

Where they come from depends on the weights mode (docs/engine.md section 5):

- ``float32`` and ``bfloat16`` take the loaded transformers model's float weights;
- ``int4`` and ``int8`` quantize those float weights (round to nearest), except that a model
  loaded from a GGUF file is read again from the file, so that its Q4_0/Q4_1 matrices become int4
  groups exactly as stored (no second rounding) and its Q8_0 matrices are requantized per row;
- ``auto`` serves a GGUF file's 4-bit matrices as int4 and its 8-bit ones as int8 (where the kernels
  pass their self-check), and float weights as they are.

Packing a model takes seconds, so the packed tensors of a GGUF model are kept in a file next to the
model's converted folder and read back on later starts.

This module must never change the model object it reads, and never keep a weight in a form the
self-check of :mod:`sfnode.engines.kernels.quant` did not pass: a failed kernel falls back to float,
with one log line that says why.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from twisted.logger import Logger

from sfnode.engines import WEIGHT_MODES
from sfnode.engines.kernels import native
from sfnode.engines.kernels.choice import FAMILIES, Choice, Cpu, Measure, choose, measure_product
from sfnode.engines.kernels.quant import (
    GgufMatrix,
    Linear,
    Precision,
    Projection,
    Q8Rows,
    dense_rows,
    dequantize,
    from_gguf,
    kernel_works,
    linear_from_state,
    onednn_works,
    quantize,
)

log = Logger(namespace="sfnode.engines.weights")


_GGUF_PARTS = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}
_CACHE_FORMAT = 2


class WeightsError(Exception):
    """The weights cannot be served in the mode asked for; the message says why."""


@dataclass
class LayerWeights:
    """One decoder layer: norms as float tensors, projections as kernels."""

    input_norm: torch.Tensor
    qkv: Projection
    o: Projection
    post_norm: torch.Tensor
    gate_up: Projection
    down: Projection


@dataclass
class LlamaWeights:
    """Everything a Llama decode step reads, in the dtypes the runner computes in."""

    mode: str
    """The weights mode after ``auto`` was resolved (``int4`` when any matrix is int4)."""
    activations: torch.dtype
    embed: torch.Tensor | Q8Rows
    """The token embedding: a tensor in ``activations``, or a GGUF file's Q8_0 table read a row
    at a time (float32 activations only)."""
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: Linear
    lm_head_float: torch.Tensor | Q8Rows | None
    """The output head's float32 weights (the model's own tensor, or its Q8_0 rows when the
    file holds it so) when the head is quantized: the best logits of each row are computed
    again from them."""
    final_norm_float: torch.Tensor
    eps: float
    heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    dense_rows: int | None = None
    """Prompt chunks of at least this many rows use the projections' dense copies (None: no
    copies; decode rows always use the kernels)."""
    family: Choice | None = None
    """The kernel family of the quantized matrices and why it was chosen."""
    kv_dtype: torch.dtype | None = None
    """How keys and values are stored (None: in :attr:`activations`)."""
    holds_model_embedding: bool = True
    """Whether :attr:`embed` or :attr:`lm_head_float` is the model's own embedding tensor (else
    the model's embedding and head may be released)."""

    @property
    def hidden(self) -> int:
        return int(self.embed.shape[1])

    def describe(self) -> str:
        """A short account of the kernels, for the log: ``int4 x 120, int8 x 1``."""
        counts = Counter(
            projection.precision.value
            for block in self.layers
            for projection in (block.qkv, block.o, block.gate_up, block.down)
        )
        counts[self.lm_head.precision.value] += 1
        return ", ".join(f"{name} x {n}" for name, n in sorted(counts.items()))


# -- GGUF ----------------------------------------------------------------------------------------

_GGUF_LAYER = {
    "attn_q": "q",
    "attn_k": "k",
    "attn_v": "v",
    "attn_output": "o",
    "ffn_gate": "gate",
    "ffn_up": "up",
    "ffn_down": "down",
}


def _unpermute_order(rows: int, heads: int) -> np.ndarray[Any, np.dtype[np.int64]]:
    """Row order that undoes the query/key permutation GGUF converters apply to Llama weights.

    Converters interleave each head's two rotary halves; transformers' layout keeps them apart.
    Row ``i`` of the transformers matrix is row ``order[i]`` of the GGUF one.
    """
    half = rows // heads // 2
    order = np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(rows)
    return order


_GGUF_TYPES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0"}
"""The ggml type numbers of the quantized kinds served from the file (:data:`GGUF_KINDS`)."""
_GGUF_BLOCK = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34)}
"""Per kind: values per block and bytes per block."""


def read_gguf_matrices(path: Path, heads: int, kv_heads: int) -> dict[str, GgufMatrix]:
    """The quantized matrices of a Llama GGUF file, by ``"{layer}.{q|k|v|o|gate|up|down}"`` and
    ``"embed"`` / ``"lm_head"``, rows in transformers' order.  Float tensors are left out.

    The tensor table is walked by :func:`sfnode.engines.weights.gguf.read_tensor_table` (which skips
    the metadata, a 49152-token vocabulary included, without decoding it) and each matrix is a
    read-only memory map of its bytes: nothing is copied but the query and key rows reordered.
    """
    from sfnode.engines.weights.gguf import GgufFormatError, impossible_tensor, read_tensor_table

    try:
        entries = read_tensor_table(path)
        problem = impossible_tensor(entries, path.stat().st_size)
    except (OSError, GgufFormatError) as e:
        raise WeightsError(f"cannot read the tensors of {path}: {e}") from e
    if problem is not None:
        raise WeightsError(f"the GGUF file {path} is refused: {problem}")
    found: dict[str, GgufMatrix] = {}
    for entry in entries:
        kind = _GGUF_TYPES.get(entry.type)
        if kind is None or len(entry.shape) != 2:
            continue
        values, size = _GGUF_BLOCK[kind]
        cols, rows = entry.shape
        data = np.memmap(
            path, dtype=np.uint8, mode="r", offset=entry.offset, shape=(rows, cols // values * size)
        )
        name = entry.name.removesuffix(".weight")
        matrix = GgufMatrix(kind, rows, cols, data)
        if name == "token_embd":
            found["embed"] = matrix
        elif name == "output":
            found["lm_head"] = matrix
        elif name.startswith("blk."):
            _, index, part = name.split(".", 2)
            short = _GGUF_LAYER.get(part)
            if short is None:
                continue
            if short == "q":
                matrix = matrix.take_rows(_unpermute_order(rows, heads))
            elif short == "k":
                matrix = matrix.take_rows(_unpermute_order(rows, kv_heads))
            found[f"{int(index)}.{short}"] = matrix
    return found


# -- choosing kernels --------------------------------------------------------------------------


def usable_precisions() -> dict[Precision, str | None]:
    """Each precision's self-check result (None: usable)."""
    return {p: kernel_works(p) for p in Precision}


CHECKS_FILE = "kernel-checks.json"
"""The kernels' self-check results kept beside the packed weights, per CPU kind and torch."""


def cached_precisions(folder: Path | None) -> dict[Precision, str | None]:
    """:func:`usable_precisions`, read from ``folder``'s :data:`CHECKS_FILE` when it holds this
    CPU kind's results (its flags and torch's version: what the results depend on), else run
    and kept there (best effort)."""
    if folder is None:
        return usable_precisions()
    key = Cpu.here().key()
    path = folder / CHECKS_FILE
    kept: dict[str, Any] = {}
    try:
        kept = json.loads(path.read_text())
        results = kept[key]
        checks = {Precision(name): results[name] for name in (p.value for p in Precision)}
        if all(reason is None or isinstance(reason, str) for reason in checks.values()):
            return checks
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        kept = kept if isinstance(kept, dict) else {}
    checks = usable_precisions()
    kept[key] = {p.value: reason for p, reason in checks.items()}
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{CHECKS_FILE}.", dir=folder)
        with os.fdopen(fd, "w") as out:
            json.dump(kept, out, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:
        log.warn("cannot keep the kernels' self-checks in {path}: {e}", path=str(path), e=e)
    return checks


def _fallback(wanted: Precision, checks: dict[Precision, str | None]) -> Precision:
    """``wanted`` if its kernel works, else bfloat16 if that works, else float32."""
    if checks.get(wanted) is None:
        return wanted
    for other in (Precision.BFLOAT16, Precision.FLOAT32):
        if checks.get(other) is None:
            return other
    return Precision.FLOAT32


def _gguf_precision(kind: str | None, mode: str) -> Precision:
    if mode != "auto":
        return Precision(mode)
    if kind in ("Q4_0", "Q4_1"):
        return Precision.INT4
    if kind == "Q8_0":
        return Precision.INT8
    return Precision.FLOAT32


# -- gathering ---------------------------------------------------------------------------------


def _wanted(
    inner: Any, config: Any, matrices: dict[str, GgufMatrix], mode: str
) -> dict[str, Precision]:
    """The precision ``mode`` asks for, per projection (``"{layer}.{qkv|o|gate_up|down}"``)."""
    wanted: dict[str, Precision] = {}
    for index in range(len(inner.layers)):
        for short, parts in _GGUF_PARTS.items():
            kinds = {
                matrices[f"{index}.{p}"].kind if f"{index}.{p}" in matrices else None for p in parts
            }
            kind = kinds.pop() if len(kinds) == 1 else None
            wanted[f"{index}.{short}"] = _gguf_precision(kind, mode)
    head_source = _head_source(matrices, config)
    head = _gguf_precision(head_source.kind if head_source else None, mode)
    if mode == "auto" and head is Precision.INT8:
        # The head's best logits are computed again in float32 (LlamaRunner._logits), which
        # makes an int4 head as good as an int8 one here (perplexity within 1%), at half the
        # time: torch's int8 kernel multiplies the head 2.3 times slower than its int4 kernel.
        head = Precision.INT4
    wanted["lm_head"] = head
    return wanted


def _head_source(matrices: dict[str, GgufMatrix], config: Any) -> GgufMatrix | None:
    """The file's matrix of the output head: its own, or the embedding's when the model ties
    them."""
    return matrices.get("lm_head") or (
        matrices.get("embed") if getattr(config, "tie_word_embeddings", False) else None
    )


def _float(module: Any) -> torch.Tensor:
    weight: torch.Tensor = module.weight.detach()
    return weight.to(torch.float32)


def gather_weights(
    model: Any,
    mode: str,
    *,
    gguf: Path | None = None,
    cache_file: Path | None = None,
    checks: dict[Precision, str | None] | None = None,
    dense_copies: bool = True,
    kernels: str = "auto",
    cpu: Cpu | None = None,
    measure: Measure = measure_product,
    library_dir: Path | None = None,
    fused_step: bool = True,
) -> LlamaWeights:
    """The weights of a transformers Llama ``model`` for ``mode`` (see the module docstring).

    ``gguf`` is the file the model was loaded from, if any; ``cache_file`` where packed weights
    are kept between starts (only used together with ``gguf``; the kernel choice and the native
    library are kept in its folder).  ``checks`` overrides the kernel self-checks (tests use it
    to simulate a CPU without a kernel).  ``dense_copies`` lets long prompt chunks use bfloat16
    copies of quantized weights where that is measured to be faster.  ``kernels`` is the family
    of the kernels (:mod:`sfnode.engines.kernels.choice`): ``auto`` measures on ``cpu`` (this one by
    default) with ``measure``; ``torch`` or ``native`` forces one.  ``library_dir`` is
    where the native kernels are built when there is no ``cache_file``; ``fused_step`` says
    whether the runner will fuse each layer's work with the native kernels (it counts in the
    measurement).
    """
    device = next(model.parameters()).device
    _check_mode(mode, device)
    if checks is None:
        checks = cached_precisions(cache_file.parent if cache_file is not None else None)
    config, inner = model.config, model.model
    heads, kv_heads, _ = _attention_shape(config)
    matrices = _read_matrices(gguf, mode, heads, kv_heads)
    if mode == "auto" and not matrices:
        float32 = next(model.parameters()).dtype == torch.float32
        mode = "float32" if device.type == "cpu" and float32 else "bfloat16"
    wanted = _wanted(inner, config, matrices, mode)
    family = _choose_family(
        inner, wanted, mode, kernels, device, cpu, measure, cache_file, library_dir, fused_step
    )
    if family.family == "native":
        chosen = dict(wanted)
    else:
        chosen = {name: _fallback(p, checks) for name, p in wanted.items()}
    linears = _kept_or_packed(
        model, matrices, wanted, chosen, family, checks, mode=mode, gguf=gguf, cache_file=cache_file
    )
    _warn_fallbacks(wanted, family, checks)
    return _assemble(model, mode, matrices, chosen, linears, family, dense_copies)


def _kept_or_packed(
    model: Any,
    matrices: dict[str, GgufMatrix],
    wanted: dict[str, Precision],
    chosen: dict[str, Precision],
    family: Choice,
    checks: dict[Precision, str | None],
    *,
    mode: str,
    gguf: Path | None,
    cache_file: Path | None,
) -> dict[str, Linear]:
    """Every projection's kernel: read back from ``cache_file`` where a GGUF model's were
    packed for the same signature, else packed now (and kept there for the next start)."""
    signature, cache_file = _cache_signature(mode, checks, family, cache_file)
    cached = _load_cache(cache_file, signature, family.library) if gguf is not None else None
    if cached is not None and cached[0] == wanted:
        # Packed from this very file (the cache folder is named by its content) after the
        # layout check of _packed passed.
        return cached[1]
    device = next(model.parameters()).device
    linears = _packed(model, matrices, chosen, family, device)
    if gguf is not None and cache_file is not None and _any_integer(chosen):
        _save_cache(cache_file, signature, wanted, linears)
    return linears


def _assemble(
    model: Any,
    mode: str,
    matrices: dict[str, GgufMatrix],
    chosen: dict[str, Precision],
    linears: dict[str, Linear],
    family: Choice,
    dense_copies: bool,
) -> LlamaWeights:
    """The weights the runner reads, in the activation type the family computes in."""
    config, inner = model.config, model.model
    heads, kv_heads, head_dim = _attention_shape(config)
    quantized = any(p is not Precision.FLOAT32 for p in chosen.values())
    activations = torch.float32 if family.family == "native" or not quantized else torch.bfloat16
    embed, head_float = _embedding_and_head(model, matrices, linears["lm_head"], activations)
    projections = {
        name: Projection(linear, bias=_bias(inner, name, activations))
        for name, linear in linears.items()
        if name != "lm_head"
    }
    threshold = None
    if dense_copies and family.family == "torch" and _any_integer(chosen):
        projections, threshold = _with_dense_copies(projections)
    served = sorted({p.value for p in chosen.values()}, key=WEIGHT_MODES.index)
    return LlamaWeights(
        mode=served[-1] if mode == "auto" else mode,
        activations=activations,
        embed=embed,
        layers=_layers(inner, projections, activations),
        final_norm=_float(inner.norm).to(activations),
        lm_head=linears["lm_head"],
        lm_head_float=head_float,
        final_norm_float=_float(inner.norm),
        eps=float(config.rms_norm_eps),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=int(config.vocab_size),
        dense_rows=threshold,
        family=family,
        # Half the memory of float32 keys and values, rounded as llama.cpp rounds its own; the
        # float32 mode keeps its exact path.
        kv_dtype=torch.float16 if family.family == "native" and quantized else None,
        holds_model_embedding=not (
            isinstance(embed, Q8Rows) and (head_float is None or isinstance(head_float, Q8Rows))
        ),
    )


def _check_mode(mode: str, device: torch.device) -> None:
    """A :class:`WeightsError` for a mode that does not exist, or that ``device`` cannot run."""
    if mode not in WEIGHT_MODES:
        raise WeightsError(
            f"unknown weights mode {mode!r}; expected one of {', '.join(WEIGHT_MODES)}"
        )
    if device.type != "cpu" and mode in ("int4", "int8"):
        raise WeightsError(f"--weights {mode} needs the CPU kernels; use bfloat16 on {device}")


def _attention_shape(config: Any) -> tuple[int, int, int]:
    """(query heads, key/value heads, head size) of a transformers Llama ``config``."""
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return heads, kv_heads, head_dim


def _read_matrices(
    gguf: Path | None, mode: str, heads: int, kv_heads: int
) -> dict[str, GgufMatrix]:
    """The GGUF file's quantized matrices, where ``mode`` serves any (else none)."""
    if gguf is None or mode not in ("auto", "int4", "int8"):
        return {}
    started = time.monotonic()
    matrices = read_gguf_matrices(gguf, heads, kv_heads)
    log.info(
        "read the quantized matrices of {gguf} in {s:.1f} s",
        gguf=str(gguf),
        s=time.monotonic() - started,
    )
    return matrices


def _any_integer(chosen: dict[str, Precision]) -> bool:
    """Whether any projection is int4 or int8."""
    return any(p in (Precision.INT4, Precision.INT8) for p in chosen.values())


def _cache_signature(
    mode: str, checks: dict[Precision, str | None], family: Choice, cache_file: Path | None
) -> tuple[dict[str, str], Path | None]:
    """What packed weights kept in a file must have been packed for, and that file."""
    signature = {
        "format": str(_CACHE_FORMAT),
        "torch": torch.__version__,
        "mode": mode,
        "usable": ",".join(sorted(p.value for p, reason in checks.items() if reason is None)),
    }
    if family.family == "native":
        # Another file for another layout, so that older code keeps reading its own.
        signature["family"] = "native-tiles2"
        signature["usable"] = "native"
        if cache_file is not None:
            cache_file = cache_file.with_name(f"{cache_file.stem}-tiles2{cache_file.suffix}")
    return signature, cache_file


def _packed(
    model: Any,
    matrices: dict[str, GgufMatrix],
    chosen: dict[str, Precision],
    family: Choice,
    device: torch.device,
) -> dict[str, Linear]:
    """Every projection's kernel packed now, after the file's layout is checked against the
    loaded model."""
    inner = model.model
    if matrices:
        _check_gguf_layout(matrices, inner)
    onednn = device.type == "cpu" and onednn_works()
    head_source = _head_source(matrices, model.config)
    return _build_linears(inner, model, matrices, chosen, head_source, onednn, family.library)


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


def _embedding_and_head(
    model: Any, matrices: dict[str, GgufMatrix], lm_head: Linear, activations: torch.dtype
) -> tuple[torch.Tensor | Q8Rows, torch.Tensor | Q8Rows | None]:
    """The token embedding, and the head's float rows where the head is quantized: a GGUF
    file's Q8_0 embedding is read a row at a time in float32 (and is the head's rows too when
    the model ties them)."""
    head_float: torch.Tensor | Q8Rows | None = None
    if lm_head.precision is not Precision.FLOAT32 and model.lm_head.weight.dtype == torch.float32:
        head_float = model.lm_head.weight.detach()
    embed: torch.Tensor | Q8Rows = model.model.embed_tokens.weight.detach().to(activations)
    stored = matrices.get("embed")
    if stored is not None and stored.kind == "Q8_0" and activations == torch.float32:
        # Bit for bit the model's rows (it was dequantized from them), at a quarter of the
        # memory; the head's float rows are the same table when the model ties them.
        embed = Q8Rows(stored)
        if head_float is not None and getattr(model.config, "tie_word_embeddings", False):
            head_float = embed
    return embed, head_float


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


def _layers(
    inner: Any, projections: dict[str, Projection], activations: torch.dtype
) -> list[LayerWeights]:
    """Each decoder layer's norms (in ``activations``) and projections."""
    return [
        LayerWeights(
            input_norm=_float(layer.input_layernorm).to(activations),
            qkv=projections[f"{index}.qkv"],
            o=projections[f"{index}.o"],
            post_norm=_float(layer.post_attention_layernorm).to(activations),
            gate_up=projections[f"{index}.gate_up"],
            down=projections[f"{index}.down"],
        )
        for index, layer in enumerate(inner.layers)
    ]


def _choose_family(
    inner: Any,
    wanted: dict[str, Precision],
    mode: str,
    kernels: str,
    device: torch.device,
    cpu: Cpu | None,
    measure: Measure,
    cache_file: Path | None,
    library_dir: Path | None,
    fused_step: bool,
) -> Choice:
    """The kernel family of the mode's matrices (:mod:`sfnode.engines.kernels.choice`), logged."""
    precisions = set(wanted.values())
    quantized = precisions & {Precision.INT4, Precision.INT8}
    all_float32 = precisions == {Precision.FLOAT32}
    if device.type != "cpu" or not (quantized or all_float32):
        return Choice("torch", "only torch's kernels serve these weights", all_float32=all_float32)
    if kernels not in ("auto", *FAMILIES):
        raise WeightsError(f"kernels must be auto, {' or '.join(FAMILIES)}, not {kernels!r}")
    cpu = cpu or Cpu.here()
    if library_dir is None:
        library_dir = cache_file.parent if cache_file is not None else _default_library_dir()
    if kernels == "torch":
        choice = Choice("torch", "asked for", all_float32=all_float32)
    elif kernels == "native":
        loaded = native.load(library_dir, cpu.flags)
        if isinstance(loaded, str):
            raise WeightsError(f"sfnode's native kernels cannot be used here: {loaded}")
        choice = Choice("native", "asked for", library=loaded, all_float32=all_float32)
    else:
        layer0 = _projection_modules(inner.layers[0])
        choice = choose(
            _layer0_samples(inner, wanted, all_float32),
            cpu=cpu,
            library_dir=library_dir,
            cache_file=(cache_file.parent / CHOICE_FILE) if cache_file is not None else None,
            measure=measure,
            native_fused=fused_step
            and all(getattr(m, "bias", None) is None for parts in layer0.values() for m in parts),
        )
    _log_choice(choice, mode, cpu)
    return choice


def _layer0_samples(
    inner: Any, wanted: dict[str, Precision], all_float32: bool
) -> dict[str, tuple[torch.Tensor, Precision]]:
    """Layer 0's projections the family is measured on, as float weights and the precision the
    mode wants for each (the embedding when none is measured)."""
    measured = (Precision.INT4, Precision.INT8, Precision.FLOAT32)
    samples: dict[str, tuple[torch.Tensor, Precision]] = {}
    for short, modules in _projection_modules(inner.layers[0]).items():
        precision = wanted.get(f"0.{short}")
        if precision in measured and (precision is not Precision.FLOAT32 or all_float32):
            samples[short] = (torch.cat([_float(m) for m in modules]), precision)
    if not samples:
        samples["lm_head"] = (_float(inner.embed_tokens), wanted["lm_head"])
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


CHOICE_FILE = "kernel-choice.json"
"""The kernel choices kept beside the packed weights (:mod:`sfnode.engines.kernels.choice`)."""


def _default_library_dir() -> Path:
    from sfnode.engines.weights.loading import default_cache_dir

    return default_cache_dir().parent / "kernels"


def _projection_modules(layer: Any) -> dict[str, tuple[Any, ...]]:
    """The transformers modules each fused projection of a decoder layer is made of."""
    attention, mlp = layer.self_attn, layer.mlp
    return {
        "qkv": (attention.q_proj, attention.k_proj, attention.v_proj),
        "o": (attention.o_proj,),
        "gate_up": (mlp.gate_proj, mlp.up_proj),
        "down": (mlp.down_proj,),
    }


def _bias(inner: Any, name: str, dtype: torch.dtype) -> torch.Tensor | None:
    """The bias of projection ``name`` (the fused parts' biases joined), or None."""
    index, short = name.split(".")
    modules = _projection_modules(inner.layers[int(index)])[short]
    biases = [getattr(module, "bias", None) for module in modules]
    if all(b is None for b in biases):
        return None
    parts = [
        b.detach().to(torch.float32)
        if b is not None
        else torch.zeros(module.out_features, dtype=torch.float32)
        for b, module in zip(biases, modules, strict=True)
    ]
    return torch.cat(parts).to(dtype)


def _check_gguf_layout(matrices: dict[str, GgufMatrix], inner: Any) -> None:
    """The file's first layer, dequantized, must be the loaded model's (catches a row order or a
    naming this module does not know, before anything is served from it)."""
    layer = inner.layers[0]
    for short, module in (
        ("q", layer.self_attn.q_proj),
        ("k", layer.self_attn.k_proj),
        ("down", layer.mlp.down_proj),
    ):
        matrix = matrices.get(f"0.{short}")
        if matrix is None:
            continue
        if not torch.allclose(dequantize(matrix), _float(module), rtol=1e-5, atol=1e-6):
            raise WeightsError(
                f"the GGUF file's layer 0 {short} matrix does not match the loaded model; "
                "serve it with --weights float32"
            )


def _build_linears(
    inner: Any,
    model: Any,
    matrices: dict[str, GgufMatrix],
    chosen: dict[str, Precision],
    head_source: GgufMatrix | None,
    onednn: bool,
    library: native.Library | None = None,
) -> dict[str, Linear]:
    """The kernels of every projection; with ``library`` the quantized ones are the native
    float32-activation kernels, else torch's."""
    started = time.monotonic()
    linears: dict[str, Linear] = {}

    def build(stored: list[GgufMatrix | None], weight: Any, precision: Precision) -> Linear:
        complete = [m for m in stored if m is not None]
        if library is not None and precision in (Precision.INT4, Precision.INT8, Precision.FLOAT32):
            if precision is Precision.INT4 and len(complete) == len(stored):
                if all(m.kind in ("Q4_0", "Q4_1") for m in complete):
                    return native.Q4Linear(native.gguf_blocks(complete), complete[0].cols, library)
            from sfnode.engines.kernels.choice import family_layer

            return family_layer("native", weight(), precision, library)
        if precision is Precision.INT4 and len(complete) == len(stored):
            return from_gguf(complete, precision)
        return quantize(weight(), precision, onednn=onednn)

    for index, layer in enumerate(inner.layers):
        float_parts = _projection_modules(layer)
        for short, parts in _GGUF_PARTS.items():
            name = f"{index}.{short}"
            modules = float_parts[short]
            linears[name] = build(
                [matrices.get(f"{index}.{p}") for p in parts],
                lambda modules=modules: torch.cat([_float(module) for module in modules]),
                chosen[name],
            )
    head_stored = [head_source if head_source is not None and head_source.kind != "Q8_0" else None]
    linears["lm_head"] = build(head_stored, lambda: _float(model.lm_head), chosen["lm_head"])
    log.info("packed the weights in {s:.1f} s", s=time.monotonic() - started)
    return linears


def _load_cache(
    path: Path | None, signature: dict[str, str], library: native.Library | None = None
) -> tuple[dict[str, Precision], dict[str, Linear]] | None:
    """``(wanted precisions, layers)`` from a packed-weights file written for ``signature``."""
    if path is None or not path.is_file():
        return None
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if any(meta.get(key) != value for key, value in signature.items()):
                return None
            wanted = {k: Precision(v) for k, v in json.loads(meta["wanted"]).items()}
            chosen = {k: Precision(v) for k, v in json.loads(meta["chosen"]).items()}
            # The reader gives each tensor in memory of its own; only one that does not start
            # on a 64-byte boundary is copied again: the quantized kernels' vector loads expect
            # that alignment (the int8 kernel crashed on an 8-byte aligned one), and a fresh
            # tensor has it.
            tensors = {}
            for key in f.keys():
                tensor = f.get_tensor(key)
                tensors[key] = tensor if tensor.data_ptr() % 64 == 0 else tensor.clone()
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        log.warn("ignoring unreadable packed weights {path}: {e}", path=str(path), e=e)
        return None
    linears: dict[str, Linear] = {}
    for name, precision in chosen.items():
        prefix = f"{name}/"
        state = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        if library is not None and precision is Precision.INT4:
            linears[name] = native.Q4Linear(
                None,
                int(state["in_features"].item()),
                library,
                tiles=state["tiles"],
                out_features=int(state["out_features"].item()),
            )
        elif library is not None and precision is Precision.INT8:
            linears[name] = native.Q8Linear(state["weight"], state["scales"], library)
        else:
            linears[name] = linear_from_state(precision, state)
    log.info("read packed weights from {path}", path=str(path))
    return wanted, linears


def _save_cache(
    path: Path,
    signature: dict[str, str],
    wanted: dict[str, Precision],
    linears: dict[str, Linear],
) -> None:
    from safetensors.torch import save_file

    tensors = {
        f"{name}/{key}": value.contiguous()
        for name, layer in linears.items()
        for key, value in layer.state().items()
    }
    meta = dict(signature)
    meta["wanted"] = json.dumps({k: v.value for k, v in wanted.items()})
    meta["chosen"] = json.dumps({k: v.precision.value for k, v in linears.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    log.info("kept the packed weights in {path}", path=str(path))
