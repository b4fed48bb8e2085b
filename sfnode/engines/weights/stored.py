"""A model's weights read as they are stored, by sfnode's names, from a GGUF file or a Hugging
Face folder of safetensors files (docs/engine.md section 5.4).

:func:`read_gguf` and :func:`read_folder` give a :class:`StoredModel`: the model's
:class:`~sfnode.engines.families.spec.ModelSpec` and each tensor as a :class:`StoredTensor`, its
bytes in the file's own format (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K), memory
mapped.  The names are sfnode's: ``embed``, ``final_norm``, ``lm_head`` (absent when the head is
the embedding), and per layer ``"{i}.{part}"`` with the parts of :data:`LAYER_PARTS`.  Reading
undoes what the files do differently:

- llama.cpp's converter interleaves the two rotary halves of each head's query and key rows for
  the ``llama`` architecture: the rows are put back in order (whole rows move, so a block format
  is permuted without touching a block);
- fused matrices (Phi-3's query/key/value and gate/up) are split by rows (views, no copy);
- a folder's norm weights get the family's norm offset added (Gemma's ``1 + w``, which a GGUF
  file stores added), so that both give the same weights.

Nothing is dequantized or inflated: what is held is the file's bytes (maps: copy-on-write, so
that they can be handed to torch as writable arrays; nothing writes them, so they stay the
file's pages) and the few rows moved.  A model in memory (a transformers model's arrays) is read
the same way by :func:`read_arrays`, over its own arrays.  A tensor no family part names, a
format not listed, or a shape that does not fit the spec is refused by name.  This module never
imports torch.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from sfnode.engines import ModelLoadError
from sfnode.engines.families import family_of_architecture, spec_from_config, spec_from_gguf
from sfnode.engines.families.spec import NORMS, ModelSpec
from sfnode.engines.kernels.blocks import BY_TYPE, FORMATS, dequantize
from sfnode.engines.weights.gguf import GgufFormatError, impossible_tensor, read_header

LAYER_PARTS = (
    "attn_norm",
    "q",
    "k",
    "v",
    "q_bias",
    "k_bias",
    "v_bias",
    "q_norm",
    "k_norm",
    "o",
    "o_bias",
    "attn_post_norm",
    "mlp_norm",
    "gate",
    "up",
    "down",
    "gate_bias",
    "up_bias",
    "down_bias",
    "mlp_post_norm",
)
"""The parts of a layer, each read as one tensor (a fused file tensor gives several)."""

_GGUF_LAYER = {
    "attn_norm": "attn_norm",
    "attn_q": "q",
    "attn_k": "k",
    "attn_v": "v",
    "attn_qkv": "qkv",
    "attn_q_norm": "q_norm",
    "attn_k_norm": "k_norm",
    "attn_output": "o",
    "post_attention_norm": "attn_post_norm",
    "ffn_norm": "mlp_norm",
    "ffn_gate": "gate",
    "ffn_up": "up",
    "ffn_down": "down",
    "post_ffw_norm": "mlp_post_norm",
}
_GGUF_GLOBAL = {"token_embd": "embed", "output_norm": "final_norm", "output": "lm_head"}
_GGUF_SPEC_ONLY = frozenset({"rope_freqs.weight"})
"""Tensors the spec holds (llama3's frequency factors), not weights."""

_HF_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "q",
    "self_attn.k_proj": "k",
    "self_attn.v_proj": "v",
    "self_attn.qkv_proj": "qkv",
    "self_attn.q_norm": "q_norm",
    "self_attn.k_norm": "k_norm",
    "self_attn.o_proj": "o",
    "post_attention_layernorm": "post_attention_layernorm",
    "pre_feedforward_layernorm": "mlp_norm",
    "post_feedforward_layernorm": "mlp_post_norm",
    "mlp.gate_proj": "gate",
    "mlp.up_proj": "up",
    "mlp.gate_up_proj": "gate_up",
    "mlp.down_proj": "down",
}
_HF_GLOBAL = {"model.embed_tokens": "embed", "model.norm": "final_norm", "lm_head": "lm_head"}
_SAFETENSORS_KINDS = {"F32": "F32", "F16": "F16", "BF16": "BF16"}


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as stored: its format, its shape (rows first) and its bytes."""

    kind: str
    """A format of :data:`sfnode.engines.kernels.blocks.FORMATS`."""
    shape: tuple[int, ...]
    """``(rows, cols)`` for a matrix, ``(n,)`` for a vector."""
    data: np.ndarray[Any, np.dtype[np.uint8]]
    """``[rows, bytes a row]`` (``[bytes]`` for a vector): a memory map of the file where the
    rows are in order, else the rows moved."""

    @property
    def cols(self) -> int:
        return self.shape[-1]

    @property
    def rows(self) -> int:
        return self.shape[0] if len(self.shape) == 2 else 1

    def float32(self) -> np.ndarray[Any, np.dtype[np.float32]]:
        """The values in float32 (what the file means; a copy)."""
        return dequantize(self.kind, self.data, self.cols).reshape(self.shape)

    def values(self) -> np.ndarray[Any, np.dtype[np.float32]]:
        """The values in float32: a view of the stored bytes where they are F32 (the file's
        pages, or the array the tensor was made from), else :meth:`float32`'s copy."""
        if self.kind == "F32" and self.data.flags.c_contiguous:
            return self.data.view("<f4").reshape(self.shape)
        return self.float32()

    def take_rows(self, order: np.ndarray[Any, Any]) -> StoredTensor:
        """The rows (the elements of a vector) in ``order``."""
        if len(self.shape) == 1:
            per = FORMATS[self.kind].size // FORMATS[self.kind].weights
            moved = self.data.reshape(-1, per)[order].reshape(-1)
            return replace(self, data=np.ascontiguousarray(moved))
        return replace(self, data=np.ascontiguousarray(self.data[order]))

    def split_rows(self, sizes: Sequence[int]) -> list[StoredTensor]:
        """Consecutive row ranges of ``sizes`` (views)."""
        if sum(sizes) != self.shape[0]:
            raise ValueError(f"rows {list(sizes)} do not add up to {self.shape[0]}")
        parts, start = [], 0
        for size in sizes:
            shape = (size, *self.shape[1:])
            if len(self.shape) == 1:
                per = FORMATS[self.kind].size // FORMATS[self.kind].weights
                data = self.data[start * per : (start + size) * per]
            else:
                data = self.data[start : start + size]
            parts.append(StoredTensor(self.kind, shape, data))
            start += size
        return parts


@dataclass
class StoredModel:
    """A model's spec and its tensors by sfnode's names."""

    spec: ModelSpec
    tensors: dict[str, StoredTensor]
    source: Path
    file_bytes: int = 0
    """The size of the weight files read (a GGUF file whole; a folder's safetensors files):
    what the weights held are measured against (the log's and ``/metrics``' ratio)."""

    def held_bytes(self) -> int:
        """Bytes of every tensor held (mapped or moved)."""
        return sum(int(t.data.nbytes) for t in self.tensors.values())

    def describe(self) -> str:
        """The formats of the matrices, for the log: ``Q4_K x 12, Q6_K x 3``."""
        counts: dict[str, int] = {}
        for tensor in self.tensors.values():
            if len(tensor.shape) == 2:
                counts[tensor.kind] = counts.get(tensor.kind, 0) + 1
        return ", ".join(f"{kind} x {n}" for kind, n in sorted(counts.items()))


def unpermute_order(rows: int, heads: int) -> np.ndarray[Any, np.dtype[np.int64]]:
    """Row order undoing llama.cpp's query/key permutation: row ``i`` of the model's matrix is
    row ``order[i]`` of the file's (each head's rotary halves were interleaved)."""
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(rows)


# -- GGUF ----------------------------------------------------------------------------------------


def read_gguf(path: Path) -> StoredModel:
    """The spec and tensors of a GGUF file (see the module docstring).

    :raises ModelLoadError: naming the file, and the architecture, key, tensor or format that
        is refused.
    """
    try:
        metadata, entries = read_header(path)
        problem = impossible_tensor(entries, path.stat().st_size)
    except (OSError, GgufFormatError) as e:
        raise ModelLoadError(f"cannot read GGUF model {path}: {e}") from e
    if problem is not None:
        raise ModelLoadError(f"GGUF model {path} is refused: {problem}")
    by_name = {entry.name: entry for entry in entries}

    def small(name: str) -> list[float] | None:
        entry = by_name.get(name)
        if entry is None:
            return None
        values = _gguf_tensor(path, entry.shape, entry.type, entry.offset).float32()
        return [float(v) for v in values.reshape(-1)]

    spec = spec_from_gguf(metadata, {e.name: e.shape for e in entries}, small)
    family = family_of_architecture(metadata.get("general.architecture"))
    tensors: dict[str, StoredTensor] = {}
    for entry in entries:
        if entry.name in _GGUF_SPEC_ONLY:
            continue
        name = _gguf_name(entry.name, spec)
        tensor = _gguf_tensor(path, entry.shape, entry.type, entry.offset)
        tensors.update(_split(name, tensor, spec))
    if family.gguf_permutes_qk:
        tensors = _unpermute(tensors, spec)
    _check(tensors, spec, str(path))
    return StoredModel(spec, tensors, path, path.stat().st_size)


def _gguf_tensor(path: Path, dims: tuple[int, ...], ggml_type: int, offset: int) -> StoredTensor:
    form = BY_TYPE.get(ggml_type)
    if form is None:
        raise ModelLoadError(f"{path}: ggml type {ggml_type} is not a format sfnode reads")
    shape = tuple(reversed(dims))
    if len(shape) > 2:
        raise ModelLoadError(f"{path}: a tensor of {len(shape)} dimensions is not supported")
    rows = shape[0] if len(shape) == 2 else 1
    row_bytes = form.row_bytes(shape[-1])
    data = np.memmap(path, dtype=np.uint8, mode="c", offset=offset, shape=(rows, row_bytes))
    return StoredTensor(form.name, shape, data if len(shape) == 2 else data.reshape(-1))


def _gguf_name(name: str, spec: ModelSpec) -> str:
    def part(stem: str) -> str | None:
        found = _GGUF_LAYER.get(stem)
        return "gate_up" if found == "up" and spec.fused_gate_up else found

    refusal = f"{spec.family}: GGUF tensor {name!r} is not one sfnode reads"
    return _loader_name(name, r"blk\.(\d+)\.(\w+)\.(weight|bias)", part, _GGUF_GLOBAL, refusal)


def _split(name: str, tensor: StoredTensor, spec: ModelSpec) -> Iterator[tuple[str, StoredTensor]]:
    """``name`` and ``tensor``, or the parts of a fused one."""
    index, _, part = name.partition(".")
    base, bias = part.removesuffix("_bias"), part.endswith("_bias")
    suffix = "_bias" if bias else ""
    if base == "qkv":
        q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
        parts = tensor.split_rows([q, kv, kv])
        yield from ((f"{index}.{p}{suffix}", t) for p, t in zip("qkv", parts, strict=True))
    elif base == "gate_up":
        gate, up = tensor.split_rows([spec.intermediate, spec.intermediate])
        yield f"{index}.gate{suffix}", gate
        yield f"{index}.up{suffix}", up
    else:
        yield name, tensor


def _unpermute(tensors: dict[str, StoredTensor], spec: ModelSpec) -> dict[str, StoredTensor]:
    rows = {"q": spec.heads, "k": spec.kv_heads}
    for name, tensor in list(tensors.items()):
        _, _, part = name.partition(".")
        heads = rows.get(part.removesuffix("_bias"))
        if heads is not None:
            tensors[name] = tensor.take_rows(unpermute_order(tensor.shape[0], heads))
    return tensors


# -- Hugging Face folders ------------------------------------------------------------------------


def read_folder(folder: Path) -> StoredModel:
    """The spec and tensors of a Hugging Face folder (``config.json``, safetensors files).

    :raises ModelLoadError: naming the folder, and the key, tensor or format refused.
    """
    try:
        config = json.loads((folder / "config.json").read_text())
        generation_file = folder / "generation_config.json"
        generation = json.loads(generation_file.read_text()) if generation_file.is_file() else None
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read the config of {folder}: {e}") from e
    spec = spec_from_config(config, generation)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} holds no safetensors file")
    named = (pair for file in files for pair in _safetensors(file))
    try:
        stored = _from_hf(spec, named, folder)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"cannot read the weights of {folder}: {e}") from e
    stored.file_bytes = sum(file.stat().st_size for file in files)
    return stored


def read_arrays(
    config: Mapping[str, Any],
    generation: Mapping[str, Any] | None,
    arrays: Iterable[tuple[str, np.ndarray[Any, Any]]],
    source: Path,
) -> StoredModel:
    """The spec and tensors of a model held in memory (a transformers model's configuration
    and its named float arrays, shared, not copied), as :func:`read_folder` reads a folder.

    :raises ModelLoadError: naming the key or tensor refused.
    """
    spec = spec_from_config(config, generation)
    named = ((name, float_tensor(values)) for name, values in arrays)
    return _from_hf(spec, named, source)


def float_tensor(values: np.ndarray[Any, Any]) -> StoredTensor:
    """A float32 array as an F32 tensor over the same memory (a copy only where the array is
    not contiguous float32)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if values.ndim == 2:
        return StoredTensor("F32", values.shape, values.view(np.uint8))
    return StoredTensor("F32", values.shape, values.reshape(-1).view(np.uint8))


def read_model(path: Path) -> StoredModel:
    """:func:`read_gguf` for a ``.gguf`` file, :func:`read_folder` for a folder."""
    return read_folder(path) if path.is_dir() else read_gguf(path)


def _from_hf(
    spec: ModelSpec, named: Iterable[tuple[str, StoredTensor]], source: Path
) -> StoredModel:
    """The model of ``spec`` from tensors by their Hugging Face names (a tied model's head
    left out: it is the embedding)."""
    tensors: dict[str, StoredTensor] = {}
    for hf_name, tensor in named:
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        name = _hf_name(hf_name, spec)
        if name == "lm_head" and spec.tied_embeddings:
            continue
        if spec.norm_offset and name.rpartition(".")[2] in NORMS | {"final_norm"}:
            tensor = _offset(tensor, spec.norm_offset)
        tensors.update(_split(name, tensor, spec))
    _check(tensors, spec, str(source))
    return StoredModel(spec, tensors, source)


def _safetensors(path: Path) -> Iterator[tuple[str, StoredTensor]]:
    """Each tensor of a safetensors file, memory mapped."""
    with open(path, "rb") as file:
        length = int.from_bytes(file.read(8), "little")
        if length > path.stat().st_size:
            raise ModelLoadError(f"{path} is not a safetensors file")
        header = json.loads(file.read(length))
    start = 8 + length
    for name, info in header.items():
        if name == "__metadata__":
            continue
        kind = _SAFETENSORS_KINDS.get(info["dtype"])
        if kind is None:
            raise ModelLoadError(f"{path}: tensor {name!r} of dtype {info['dtype']} is refused")
        shape = tuple(int(d) for d in info["shape"])
        begin, end = info["data_offsets"]
        rows = shape[0] if len(shape) == 2 else 1
        flat = np.memmap(path, dtype=np.uint8, mode="c", offset=start + begin, shape=(end - begin,))
        yield name, StoredTensor(kind, shape, flat.reshape(rows, -1) if len(shape) == 2 else flat)


def _hf_name(name: str, spec: ModelSpec) -> str:
    def part(stem: str) -> str | None:
        found = _HF_LAYER.get(stem)
        if found == "post_attention_layernorm":
            return "attn_post_norm" if spec.sandwich_norms else "mlp_norm"
        return found

    refusal = f"{spec.family}: tensor {name!r} is not one sfnode reads"
    pattern = r"model\.layers\.(\d+)\.(.+)\.(weight|bias)"
    return _loader_name(name, pattern, part, _HF_GLOBAL, refusal)


def _loader_name(
    name: str,
    layer_pattern: str,
    part: Callable[[str], str | None],
    global_names: Mapping[str, str],
    refusal: str,
) -> str:
    """The loader's name for a stored tensor: ``{layer}.{part}`` (``_bias`` for a bias) for a
    layer's tensor (``layer_pattern`` matches its index, stem and kind; ``part`` names the
    stem, None for one not read), the global name of a global weight; else refused."""
    match = re.fullmatch(layer_pattern, name)
    if match:
        index, stem, what = match.groups()
        found = part(stem)
        if found is not None:
            return f"{int(index)}.{found}" + ("_bias" if what == "bias" else "")
    else:
        stem, _, what = name.rpartition(".")
        if what == "weight" and stem in global_names:
            return global_names[stem]
    raise ModelLoadError(refusal)


def _offset(tensor: StoredTensor, offset: float) -> StoredTensor:
    values = tensor.float32() + np.float32(offset)
    return StoredTensor("F32", tensor.shape, values.astype("<f4").view(np.uint8).reshape(-1))


# -- both ----------------------------------------------------------------------------------------


def _check(tensors: dict[str, StoredTensor], spec: ModelSpec, where: str) -> None:
    """Every tensor the spec needs is there with its shape, and no layer beyond the spec's."""
    for name, shape in expected_shapes(spec).items():
        tensor = tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"{where}: {spec.family} needs tensor {name}, which is missing")
        if tensor.shape != shape:
            raise ModelLoadError(
                f"{where}: tensor {name} has shape {list(tensor.shape)}, not {list(shape)}"
            )
    extra = sorted(set(tensors) - set(expected_shapes(spec)) - {"lm_head"})
    if extra:
        raise ModelLoadError(f"{where}: {spec.family} has no use for tensor {extra[0]}")


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor a model of ``spec`` holds, by sfnode's name, with its shape."""
    h, d = spec.hidden, spec.head_dim
    q, kv, ff = spec.heads * d, spec.kv_heads * d, spec.intermediate
    shapes: dict[str, tuple[int, ...]] = {"embed": (spec.vocab_size, h), "final_norm": (h,)}
    if not spec.tied_embeddings:
        shapes["lm_head"] = (spec.vocab_size, h)
    layer = {"attn_norm": (h,), "q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q)}
    layer.update({"mlp_norm": (h,), "gate": (ff, h), "up": (ff, h), "down": (h, ff)})
    if spec.qkv_bias:
        layer.update({"q_bias": (q,), "k_bias": (kv,), "v_bias": (kv,)})
    if spec.o_bias:
        layer["o_bias"] = (h,)
    if spec.mlp_bias:
        layer.update({"gate_bias": (ff,), "up_bias": (ff,), "down_bias": (h,)})
    if spec.qk_norm:
        layer.update({"q_norm": (d,), "k_norm": (d,)})
    if spec.sandwich_norms:
        layer.update({"attn_post_norm": (h,), "mlp_post_norm": (h,)})
    for index in range(spec.layers):
        shapes.update({f"{index}.{part}": shape for part, shape in layer.items()})
    return shapes


__all__ = [
    "LAYER_PARTS",
    "StoredModel",
    "StoredTensor",
    "expected_shapes",
    "float_tensor",
    "read_arrays",
    "read_folder",
    "read_gguf",
    "read_model",
    "unpermute_order",
]
