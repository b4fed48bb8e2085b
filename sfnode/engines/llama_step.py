"""One decode step of a Llama-family model, without the layers of Python around it.

A decode step over a batch of lanes feeds one token per lane through every layer.  On these CPUs the
weights take about 55 ms of an 80 ms step at 8 lanes; most of the rest is transformers' module
machinery (calls, hooks, keyword plumbing, mask building) run once per layer.  :class:`LlamaStep`
does the same arithmetic with the same torch operators in the same order, straight from the
model's weights, so its logits are bit-for-bit those of ``model(...)`` (tested), 7 to 10 percent
sooner (measured at 1 to 16 lanes on SmolLM2-135M).

Only plain Llama models qualify (``model_type == "llama"``, SiLU, default rotary embedding, full
attention, the stock modules): :meth:`LlamaStep.for_model` returns None for anything else, and the
engine then calls the model as usual.  This module must never be used for prefill (several tokens
per lane; the model's own forward does that) and never change what a step computes.
"""

from __future__ import annotations

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
        lanes = input_ids.shape[0]
        length = cache.get_seq_length() + 1
        hidden = self._inner.embed_tokens(input_ids)
        cos, sin = self._inner.rotary_emb(hidden, position_ids=position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        # transformers drops an all-true padding mask and then lets SDPA share key/value heads
        # itself; with padding it packs the query heads onto the key/value heads (pack_gqa).
        mask: torch.Tensor | None = None
        if bool((pad > 0).any()):
            positions = torch.arange(length, device=pad.device)
            mask = (positions.unsqueeze(0) >= pad.unsqueeze(1)).view(lanes, 1, 1, length)
        for index, layer in enumerate(self._layers):
            attention = layer.self_attn
            x = _rms_norm(hidden, layer.input_layernorm)
            shape = (lanes, 1, -1, self._head_dim)
            query = attention.q_proj.forward(x).view(shape).transpose(1, 2)
            key = attention.k_proj.forward(x).view(shape).transpose(1, 2)
            value = attention.v_proj.forward(x).view(shape).transpose(1, 2)
            query = (query * cos) + (_rotate_half(query) * sin)
            key = (key * cos) + (_rotate_half(key) * sin)
            key, value = cache.layers[index].update(key, value)
            attended = self._attend(query, key, value, mask)
            hidden = hidden + attention.o_proj.forward(attended)
            mlp = layer.mlp
            x = _rms_norm(hidden, layer.post_attention_layernorm)
            gated = torch.nn.functional.silu(mlp.gate_proj.forward(x)) * mlp.up_proj.forward(x)
            hidden = hidden + mlp.down_proj.forward(gated)
        hidden = _rms_norm(hidden, self._inner.norm)
        logits: torch.Tensor = self._model.lm_head.forward(hidden)[:, -1, :]
        return logits

    def _attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        lanes, heads, _, head_dim = query.shape
        sdpa = torch.nn.functional.scaled_dot_product_attention
        if self._groups == 1:
            out = sdpa(query, key, value, attn_mask=mask, scale=self._scaling)
        elif mask is None:
            out = sdpa(query, key, value, scale=self._scaling, enable_gqa=True)
        else:
            packed = query.reshape(lanes, heads // self._groups, self._groups, head_dim)
            out = sdpa(packed, key, value, attn_mask=mask, scale=self._scaling)
        out = out.reshape(lanes, -1, 1, head_dim).transpose(1, 2).contiguous()
        return out.reshape(lanes, 1, -1)
