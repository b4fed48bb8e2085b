"""A reference forward in plain torch over a :class:`ModelSpec` and the weights as stored, for
tests: it proves the spec and the reader (``sfnode/engines/families``,
``sfnode/engines/weights/stored.py``) say everything a family computes, before any runner uses
them (docs/engine.md section 5.4).

It recomputes the whole sequence at every step (no KV cache), in float32, one operation after
another as the families' transformers models do them; it is for tiny models only, and must never
be imported by sfnode.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from sfnode.engines.families.spec import ModelSpec
from sfnode.engines.weights.stored import StoredModel


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return normed * weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``apply_rotary_pos_emb`` on the first ``cos.shape[-1]`` dimensions."""
    dims = cos.shape[-1]
    turned, passed = x[..., :dims], x[..., dims:]
    half = dims // 2
    rotated = torch.cat((-turned[..., half:], turned[..., :half]), dim=-1)
    return torch.cat((turned * cos + rotated * sin, passed), dim=-1)


class Reference:
    """The forward of one stored model."""

    def __init__(self, stored: StoredModel) -> None:
        self.spec: ModelSpec = stored.spec
        self.w = {name: torch.from_numpy(t.float32()) for name, t in stored.tensors.items()}
        if "lm_head" not in self.w:
            self.w["lm_head"] = self.w["embed"]

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        bias = self.w.get(f"{name}_bias")
        return F.linear(x, self.w[name], bias)

    def _attention(self, i: int, h: torch.Tensor) -> torch.Tensor:
        spec, length = self.spec, h.shape[0]
        d = spec.head_dim
        q = self._linear(h, f"{i}.q").view(length, spec.heads, d).transpose(0, 1)
        k = self._linear(h, f"{i}.k").view(length, spec.kv_heads, d).transpose(0, 1)
        v = self._linear(h, f"{i}.v").view(length, spec.kv_heads, d).transpose(0, 1)
        if spec.qk_norm:
            q = _rms(q, self.w[f"{i}.q_norm"], spec.norm_eps)
            k = _rms(k, self.w[f"{i}.k_norm"], spec.norm_eps)
        cos, sin = spec.rope_of(i).cos_sin(length)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        group = spec.heads // spec.kv_heads
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        scores = torch.matmul(q, k.transpose(1, 2)) * spec.attention_scale
        if spec.attn_softcap is not None:
            scores = torch.tanh(scores / spec.attn_softcap) * spec.attn_softcap
        pos = torch.arange(length)
        allowed = pos[None, :] <= pos[:, None]
        if spec.is_sliding(i) and spec.sliding_window is not None:
            allowed &= pos[None, :] > pos[:, None] - spec.sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32), v)
        return self._linear(out.transpose(0, 1).reshape(length, -1), f"{i}.o")

    def _mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        gate, up = self._linear(h, f"{i}.gate"), self._linear(h, f"{i}.up")
        act = F.silu(gate) if self.spec.activation == "silu" else F.gelu(gate, approximate="tanh")
        return self._linear(act * up, f"{i}.down")

    def logits(self, tokens: list[int]) -> torch.Tensor:
        """The logits ``[len(tokens), vocab]`` of a whole sequence."""
        spec, eps = self.spec, self.spec.norm_eps
        x = self.w["embed"][torch.tensor(tokens)]
        if spec.embed_scale is not None:
            x = x * torch.tensor(spec.embed_scale, dtype=torch.float32)
        for i in range(spec.layers):
            out = self._attention(i, _rms(x, self.w[f"{i}.attn_norm"], eps))
            if spec.sandwich_norms:
                out = _rms(out, self.w[f"{i}.attn_post_norm"], eps)
            x = x + out
            out = self._mlp(i, _rms(x, self.w[f"{i}.mlp_norm"], eps))
            if spec.sandwich_norms:
                out = _rms(out, self.w[f"{i}.mlp_post_norm"], eps)
            x = x + out
        logits = F.linear(_rms(x, self.w["final_norm"], eps), self.w["lm_head"])
        if spec.final_softcap is not None:
            logits = torch.tanh(logits / spec.final_softcap) * spec.final_softcap
        return logits

    def greedy(self, prompt: list[int], count: int) -> list[int]:
        """Up to ``count`` greedy tokens after ``prompt`` (stopping after an EOS)."""
        tokens, new = list(prompt), []
        with torch.inference_mode():
            for _ in range(count):
                token = int(self.logits(tokens)[-1].argmax())
                new.append(token)
                tokens.append(token)
                if token in self.spec.eos_ids:
                    break
        return new


def with_stored_matrices(model: Any, stored: StoredModel) -> Any:
    """``model`` (a family's transformers model) with every matrix replaced by ``stored``'s,
    dequantized (fused ones joined again): transformers' own forward over a file's weights."""
    w = {name: torch.from_numpy(t.float32()) for name, t in stored.tensors.items()}
    joined = {
        "self_attn.qkv_proj": ("q", "k", "v"),
        "mlp.gate_up_proj": ("gate", "up"),
    }
    plain = {
        f"{side}.{part}_proj": part
        for side, parts in (("self_attn", "qkvo"), ("mlp", ("gate", "up", "down")))
        for part in parts
    }
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() != 2:
                continue
            if name == "model.embed_tokens.weight":
                parameter.copy_(w["embed"])
            elif name == "lm_head.weight":
                parameter.copy_(w.get("lm_head", w["embed"]))
            else:
                _, _, index, rest = name.split(".", 3)
                stem = rest.removesuffix(".weight")
                if stem in joined:
                    parameter.copy_(torch.cat([w[f"{index}.{p}"] for p in joined[stem]]))
                else:
                    parameter.copy_(w[f"{index}.{plain[stem]}"])
    return model


def kernel_activations(x: torch.Tensor) -> torch.Tensor:
    """``x`` as sfnode's block kernels see it (``quantize_row`` in native.c): each block of 32
    values scaled so that its largest magnitude is 32767, rounded to the nearest integer (ties
    to even), and scaled back by that largest magnitude / 32767."""
    blocks = x.to(torch.float32).reshape(*x.shape[:-1], -1, 32)
    mx = blocks.abs().amax(-1, keepdim=True)
    scale = torch.where(mx > 0, torch.tensor(32767.0) / mx, torch.zeros_like(mx))
    q = torch.round(blocks * scale)
    return (q * (mx / 32767.0)).reshape(x.shape)


def with_kernel_activations(model: Any) -> Any:
    """``model`` whose layers' matrices (not the head: the step computes its best logits again
    in float32) multiply the activations as the block kernels hold them
    (:func:`kernel_activations`): transformers' forward as sfnode's quantized kernels compute
    it, but for the order of the float sums."""
    for module in model.model.layers.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(lambda _, args: (kernel_activations(args[0]),))
    return model
