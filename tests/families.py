"""Tiny random-weight models of every family sfnode reads, written as a Hugging Face folder and
as GGUF files laid out the way llama.cpp's ``convert_hf_to_gguf.py`` lays them out (its
metadata keys, its tensor names, the permuted query/key rows of the ``llama`` architecture,
Gemma's norms with the 1 added, llama3's ``rope_freqs``, the tokenizer keys), in F32, Q8_0 (the
converter's ``--outtype q8_0``) and Q4_K_M (llama-quantize's mix, with :mod:`tests.kquant`).

Each family's configuration is the family's own transformers class with the features that make
it that family turned on (Llama 3's rope, Qwen2's biases, Qwen3's q/k norms, Mistral's window
smaller than a test's context, Gemma's soft-capping and sliding layers, Phi-3's fused matrices
and partial rotation), at a width of 256 so that every matrix row is whole K-quant blocks.

Nothing here downloads anything; a model is built in well under a second.  This module must
never be imported by sfnode.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from tests import kquant
from tests.tinymodel import TINY_EOS, tiny_tokenizer

WINDOW = 16
"""The sliding window of the families that have one: smaller than a test's context."""
CONTEXT = 128
VOCAB = 400
"""The tiny tokenizer's own size (its trainer stops at 400 tokens on its few sentences): the
models' vocabulary is exactly the tokenizer's, or Gemma 3's converter trims the embedding."""
_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 256,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": CONTEXT,
    "initializer_range": 0.2,
    "bos_token_id": 1,
    "eos_token_id": TINY_EOS,
    "pad_token_id": 0,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 500000.0,
}


def config(family: str) -> Any:
    """The transformers configuration of ``family``'s tiny model."""
    import transformers as t

    if family == "llama":
        return t.LlamaConfig(**_COMMON, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False)
    if family == "llama2":
        return t.LlamaConfig(**_COMMON, tie_word_embeddings=True)
    if family == "qwen2":
        return t.Qwen2Config(**_COMMON, tie_word_embeddings=True)
    if family == "qwen3":
        return t.Qwen3Config(**_COMMON, head_dim=64, tie_word_embeddings=False)
    if family == "mistral":
        return t.MistralConfig(**_COMMON, head_dim=64, sliding_window=WINDOW)
    if family == "gemma2":
        return t.Gemma2Config(
            **_COMMON, head_dim=64, query_pre_attn_scalar=64, sliding_window=WINDOW
        )
    if family == "gemma3":
        rope = {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        }
        common = dict(_COMMON, num_hidden_layers=6)
        return t.Gemma3TextConfig(
            **common,
            head_dim=64,
            query_pre_attn_scalar=64,
            sliding_window=WINDOW,
            rope_parameters=rope,
            tie_word_embeddings=False,
        )
    if family == "phi3":
        return t.Phi3Config(
            **_COMMON,
            original_max_position_embeddings=CONTEXT,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
        )
    raise ValueError(f"no tiny {family}")


FAMILY_NAMES = ("llama2", "llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3")
"""``llama2``: plain Llama (default rope, tied embedding, as SmolLM2); ``llama``: Llama 3's rope
(``llama3`` scaling, its factors the GGUF file's ``rope_freqs``)."""


def model(family: str, seed: int = 1234) -> Any:
    """``family``'s tiny model in float32 eval mode, random norms and biases included (a reader
    that dropped a norm's weight or a bias would read another model), eager attention."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = config(family)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    lm = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, parameter in lm.named_parameters():
            if name.endswith("norm.weight"):
                offset = 0.0 if family.startswith("gemma") else 1.0
                parameter.copy_(offset + 0.3 * torch.randn(parameter.shape, generator=generator))
            elif name.endswith(".bias"):
                parameter.copy_(0.2 * torch.randn(parameter.shape, generator=generator))
        if family == "gemma2":
            # The embedding is scaled by sqrt(hidden) = 16 and is the head too: at full size
            # it outweighs both layers, and the model only ever repeats its last token.
            lm.model.embed_tokens.weight.mul_(0.05)
    lm.generation_config.eos_token_id = TINY_EOS
    lm.generation_config.pad_token_id = 0
    return lm.eval()


def save_folder(family: str, folder: Path, seed: int = 1234) -> Path:
    """``family``'s tiny model and the tiny tokenizer as a Hugging Face folder."""
    folder.mkdir(parents=True, exist_ok=True)
    model(family, seed).save_pretrained(str(folder))
    tokenizer = tiny_tokenizer()
    if len(tokenizer) != VOCAB:
        raise AssertionError(f"the tiny tokenizer has {len(tokenizer)} tokens, not {VOCAB}")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(folder))
    return folder


CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


# -- GGUF, as llama.cpp's converter writes it ---------------------------------------------------

_ARCH = {
    "llama": "llama",
    "llama2": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3": "gemma3",
    "phi3": "phi3",
}
_FILE_TYPE = {"F32": 0, "Q8_0": 7, "Q4_K_M": 15}


def _permute(weights: np.ndarray[Any, Any], heads: int) -> np.ndarray[Any, Any]:
    """The converter's ``LlamaModel.permute``: each head's rotary halves interleaved."""
    shape = weights.shape
    return (
        weights.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
    )


def _llama3_rope_freqs(cfg: Any) -> np.ndarray[Any, Any]:
    """The converter's ``generate_extra_tensors`` for rope type llama3."""
    import torch

    params = cfg.rope_parameters
    base, dim = params["rope_theta"], cfg.head_dim
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old = params["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


def _shape_keys(writer: Any, cfg: Any) -> None:
    """The keys of the model's shape that the converter writes for every family."""
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)


def _keys(writer: Any, family: str, cfg: Any, kind: str, hparams: dict[str, Any]) -> None:
    """The metadata keys the converter writes for ``family`` (its ``set_gguf_parameters``)."""
    import gguf

    writer.add_type("model")
    writer.add_name(f"tiny-{family}")
    _shape_keys(writer, cfg)
    if family == "gemma2":
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
        writer.add_file_type(_FILE_TYPE[kind])
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
        writer.add_sliding_window(cfg.sliding_window)
        return
    if family == "phi3":
        params = cfg.rope_parameters
        writer.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        rope_dims = int(params.get("partial_rotary_factor", 1.0) * cfg.hidden_size)
        writer.add_rope_dimension_count(rope_dims // cfg.num_attention_heads)
        writer.add_rope_freq_base(params["rope_theta"])
        writer.add_file_type(_FILE_TYPE[kind])
        writer.add_sliding_window(cfg.sliding_window or 0)
        return
    params = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    if params.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(params["factor"])
    writer.add_rope_freq_base(params["rope_theta"])
    local = cfg.rope_parameters.get("sliding_attention")
    if local is not None:
        writer.add_rope_freq_base_swa(local["rope_theta"])
    if hparams.get("head_dim") is not None:
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    writer.add_file_type(_FILE_TYPE[kind])
    if _ARCH[family] == "llama":
        writer.add_vocab_size(cfg.vocab_size)
        writer.add_rope_dimension_count(cfg.head_dim)
    if family == "gemma3":
        if cfg.final_logit_softcapping:
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
        writer.add_sliding_window(cfg.sliding_window)


def _tokenizer_keys(writer: Any, folder: Path, template: str | None) -> None:
    """The converter's ``_set_vocab_gpt2`` for the tiny byte-level BPE tokenizer, and the chat
    template (none when None)."""
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    specials = {t["id"] for t in tokenizer["added_tokens"] if t.get("special")}
    tokens = [""] * len(vocab)
    for text, index in vocab.items():
        tokens[index] = text
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in specials else 1 for i in range(len(tokens))])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(TINY_EOS)
    writer.add_pad_token_id(0)
    if template is not None:
        writer.add_chat_template(template)


def _store(name: str, values: np.ndarray[Any, Any], kind: str, layers: int) -> tuple[Any, Any]:
    """(data, raw type) of tensor ``name`` in a file of ``kind``: 1-D tensors stay F32 (as the
    converter keeps them), matrices become Q8_0 or the Q4_K_M mix."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    values = values.astype(np.float32)
    if values.ndim == 1 or kind == "F32":
        return values, T.F32
    if kind == "Q8_0":
        return quantize(values, T.Q8_0), T.Q8_0
    parts = name.split(".")
    layer = int(parts[1]) if parts[0] == "blk" else None
    stem = parts[2] if layer is not None else parts[0]
    block = kquant.q4_k_m_kind(stem, layer, layers)
    return kquant.quantize(block, values), T[block]


def write_gguf(
    family: str,
    folder: Path,
    path: Path,
    kind: str = "F32",
    template: str | None = CHAT_TEMPLATE,
) -> Path:
    """The tiny folder of ``family`` (from :func:`save_folder`) as a GGUF file of ``kind``
    (``F32``, ``Q8_0`` or ``Q4_K_M``), laid out as llama.cpp's converter lays it out, with
    ``template`` as its chat template (none when None)."""
    import gguf
    from safetensors.numpy import load_file

    cfg = config(family)
    arch = _ARCH[family]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), arch)
    _keys(writer, family, cfg, kind, json.loads((folder / "config.json").read_text()))
    _tokenizer_keys(writer, folder, template)
    if kind != "F32":
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tensors = load_file(str(folder / "model.safetensors"))
    for hf_name, values in tensors.items():
        if family == "gemma2" and hf_name == "lm_head.weight":
            continue
        if hf_name.endswith("norm.weight") and family.startswith("gemma"):
            values = values + np.float32(1)
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            values = _permute(values, cfg.num_attention_heads)
        if arch == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            values = _permute(values, cfg.num_key_value_heads)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"no GGUF name for {hf_name}")
        data, raw = _store(name, values, kind, cfg.num_hidden_layers)
        writer.add_tensor(name, data, raw_dtype=raw)
    if family == "llama":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_freqs(cfg))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


_root: list[Path] = []
_written: dict[tuple[str, str], Path] = {}


def _workspace() -> Path:
    if not _root:
        _root.append(Path(tempfile.mkdtemp(prefix="sfnode-families-")))
    return _root[0]


def folder(family: str) -> Path:
    """``family``'s tiny folder, written once per test run."""
    key = (family, "folder")
    if key not in _written:
        _written[key] = save_folder(family, _workspace() / family)
    return _written[key]


def gguf(family: str, kind: str) -> Path:
    """``family``'s tiny GGUF file of ``kind`` (``F32``, ``Q8_0``, ``Q4_K_M``), written once
    per test run."""
    key = (family, kind)
    if key not in _written:
        path = _workspace() / f"{family}-{kind}.gguf"
        _written[key] = write_gguf(family, folder(family), path, kind)
    return _written[key]
