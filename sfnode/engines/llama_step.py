"""One decode step of a Llama-family model, without the layers of Python around it.

A decode step over a batch of lanes feeds one token per lane through every layer.  On these CPUs the
weights take about 55 ms of an 80 ms step at 8 lanes; most of the rest is transformers' module
machinery (calls, hooks, keyword plumbing, mask building) run once per layer.  :class:`LlamaStep`
does the same arithmetic with the same torch operators in the same order, straight from the
model's weights, so its logits are bit-for-bit those of ``model(...)`` (tested), 5 to 10 percent
sooner (measured at 1 to 16 lanes on SmolLM2-135M).

It can also carry the next prompt chunk of a lane that is being prefilled through the same pass
(:meth:`LlamaStep.logits_with_chunk`): the rows of both go through each weight matrix together,
and attention runs per part against its own cache.  Reading the weights is most of what a decode
step costs here, so the chunk's separate pass over them is saved (about 13 percent more tokens a
second at 8 lanes on SmolLM2).  Those logits equal the separate forwards' to float32 rounding,
not bit for bit (a matrix product of more rows may sum in another order).

Only plain Llama models qualify (``model_type == "llama"``, SiLU, default rotary embedding, full
attention, the stock modules): :meth:`LlamaStep.for_model` returns None for anything else, and the
engine then calls the model as usual.  This module must never change what a step computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

_STOCK_LAYER_PARTS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    "input_layernorm",
    "post_attention_layernorm",
)


def _has(module: Any, dotted: str) -> bool:
    for name in dotted.split("."):
        module = getattr(module, name, None)
        if module is None:
            return False
    return True


def _rms_norm(x: torch.Tensor, norm: Any) -> torch.Tensor:
    # LlamaRMSNorm.forward for float32 inputs, operator for operator.
    variance = x.pow(2).mean(-1, keepdim=True)
    normed: torch.Tensor = norm.weight * (x * torch.rsqrt(variance + norm.variance_epsilon))
    return normed


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaStep:
    """Decode steps for one Llama model; the KV cache and the lanes belong to the caller."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self._inner = model.model
        self._layers = list(model.model.layers)
        attention = self._layers[0].self_attn
        self._head_dim = int(attention.head_dim)
        self._groups = int(attention.num_key_value_groups)
        self._scaling = float(attention.scaling)

    @classmethod
    def for_model(cls, model: Any) -> LlamaStep | None:
        """A step for ``model`` when it is a plain float32 Llama this module reproduces exactly."""
        config = getattr(model, "config", None)
        inner = getattr(model, "model", None)
        if config is None or inner is None or getattr(config, "model_type", None) != "llama":
            return None
        rope = getattr(config, "rope_parameters", None) or {}
        if (
            getattr(config, "hidden_act", None) != "silu"
            or rope.get("rope_type", "default") != "default"
            or getattr(config, "pretraining_tp", 1) != 1
            or getattr(config, "_attn_implementation", None) != "sdpa"
            or next(model.parameters()).dtype != torch.float32
            or not hasattr(inner, "rotary_emb")
            or not hasattr(inner, "norm")
            or not hasattr(model, "lm_head")
        ):
            return None
        layers = getattr(inner, "layers", None)
        if not layers or not all(
            _has(layer, part) for layer in layers for part in _STOCK_LAYER_PARTS
        ):
            return None
        return cls(model)

    def logits(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, pad: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        """Next-token logits ``[lanes, vocab]`` for one new token per lane.

        ``input_ids`` and ``position_ids`` are ``[lanes, 1]``; ``pad[i]`` is how many positions of
        row ``i`` of ``cache`` (a ``DynamicCache`` of this model) are left padding.  The cache
        grows by one position.
        """
        return self._run([_Decode(input_ids, position_ids, pad, cache)])[0]

    def logits_with_chunk(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        pad: torch.Tensor,
        cache: Any,
        chunk_ids: torch.Tensor,
        chunk_cache: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step and one prefill chunk of another lane, in one pass over the weights.

        The decode part is :meth:`logits`.  ``chunk_ids`` (``[1, n]``) are the next ``n`` prompt
        tokens of a lane whose own cache ``chunk_cache`` holds the ones before them; it grows by
        ``n``.  Returns the decode logits and the chunk's last-position logits ``[1, vocab]``.
        Every weight matrix is read once for both, which is most of a step's cost on a CPU.
        """
        decode, chunk = self._run(
            [_Decode(input_ids, position_ids, pad, cache), _Chunk(chunk_ids, chunk_cache)]
        )
        return decode, chunk

    def _run(self, parts: list[_Decode | _Chunk]) -> list[torch.Tensor]:
        # Rows of every part go through the linear layers together, as one flat [rows, hidden]
        # matrix; attention runs per part, against that part's own cache.
        hidden = torch.cat([self._inner.embed_tokens(part.ids).flatten(0, 1) for part in parts])
        rotary = []
        for part in parts:
            cos, sin = self._inner.rotary_emb(hidden, position_ids=part.positions())
            rotary.append((cos.unsqueeze(1), sin.unsqueeze(1)))
        masks = [part.mask() for part in parts]
        sizes = [part.rows * part.width for part in parts]
        for index, layer in enumerate(self._layers):
            attention = layer.self_attn
            x = _rms_norm(hidden, layer.input_layernorm)
            query = attention.q_proj.forward(x)
            key = attention.k_proj.forward(x)
            value = attention.v_proj.forward(x)
            attended = []
            offset = 0
            for part, size, (cos, sin), mask in zip(parts, sizes, rotary, masks, strict=True):
                shape = (part.rows, part.width, -1, self._head_dim)
                rows = slice(offset, offset + size)
                offset += size
                q = query[rows].view(shape).transpose(1, 2)
                k = key[rows].view(shape).transpose(1, 2)
                v = value[rows].view(shape).transpose(1, 2)
                q = (q * cos) + (_rotate_half(q) * sin)
                k = (k * cos) + (_rotate_half(k) * sin)
                k, v = part.cache.layers[index].update(k, v)
                attended.append(self._attend(part, q, k, v, mask))
            joined = attended[0] if len(attended) == 1 else torch.cat(attended)
            hidden = hidden + attention.o_proj.forward(joined)
            mlp = layer.mlp
            x = _rms_norm(hidden, layer.post_attention_layernorm)
            gated = torch.nn.functional.silu(mlp.gate_proj.forward(x)) * mlp.up_proj.forward(x)
            hidden = hidden + mlp.down_proj.forward(gated)
        # Logits only where a next token is wanted: every decode row, a chunk's last position.
        ends = []
        offset = 0
        for part, size in zip(parts, sizes, strict=True):
            offset += size
            ends.append(
                slice(offset - part.rows, offset) if part.width == 1 else slice(offset - 1, offset)
            )
        if len(parts) == 1 and parts[0].width == 1:
            last = hidden  # a decode step alone: every row, as the model itself computes it
        else:
            last = torch.cat([hidden[rows] for rows in ends])
        logits = self._model.lm_head.forward(_rms_norm(last, self._inner.norm))
        out = []
        offset = 0
        for rows in ends:
            n = rows.stop - rows.start
            out.append(logits[offset : offset + n])
            offset += n
        return out

    def _attend(
        self,
        part: _Decode | _Chunk,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Attention of one part, as ``[rows * width, heads * head_dim]``."""
        lanes, heads, width, head_dim = query.shape
        sdpa = torch.nn.functional.scaled_dot_product_attention
        if isinstance(part, _Chunk):
            # One lane's prompt tokens: causal among themselves, all of its cached past visible.
            out = sdpa(
                query,
                key,
                value,
                attn_mask=mask,
                is_causal=mask is None,
                scale=self._scaling,
                enable_gqa=self._groups > 1,
            )
        elif self._groups == 1:
            out = sdpa(query, key, value, attn_mask=mask, scale=self._scaling)
        elif mask is None:
            # transformers drops an all-true padding mask and lets SDPA share key/value heads.
            out = sdpa(query, key, value, scale=self._scaling, enable_gqa=True)
        else:
            # With padding, transformers packs the query heads onto the key/value heads.
            packed = query.reshape(lanes, heads // self._groups, self._groups, head_dim)
            out = sdpa(packed, key, value, attn_mask=mask, scale=self._scaling)
        out = out.reshape(lanes, -1, width, head_dim).transpose(1, 2).contiguous()
        return out.reshape(lanes * width, -1)


@dataclass
class _Decode:
    """One new token for each of ``rows`` lanes sharing a left-padded cache."""

    ids: torch.Tensor
    position_ids: torch.Tensor
    pad: torch.Tensor
    cache: Any

    @property
    def rows(self) -> int:
        return int(self.ids.shape[0])

    width = 1

    def positions(self) -> torch.Tensor:
        return self.position_ids

    def mask(self) -> torch.Tensor | None:
        if not bool((self.pad > 0).any()):
            return None
        length = self.cache.get_seq_length() + 1
        columns = torch.arange(length, device=self.pad.device)
        return (columns.unsqueeze(0) >= self.pad.unsqueeze(1)).view(self.rows, 1, 1, length)


@dataclass
class _Chunk:
    """The next prompt tokens of one lane whose own cache holds the tokens before them."""

    ids: torch.Tensor
    cache: Any

    rows = 1

    @property
    def width(self) -> int:
        return int(self.ids.shape[1])

    def positions(self) -> torch.Tensor:
        past = self.cache.get_seq_length()
        return torch.arange(past, past + self.width, device=self.ids.device).unsqueeze(0)

    def mask(self) -> torch.Tensor | None:
        past = self.cache.get_seq_length()
        if past == 0:
            return None
        columns = torch.arange(past + self.width, device=self.ids.device)
        rows = torch.arange(past, past + self.width, device=self.ids.device)
        return (columns.unsqueeze(0) <= rows.unsqueeze(1)).view(1, 1, self.width, -1)
