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

import numpy as np
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


_JOINED = {"self_attn.qkv_proj": ("q", "k", "v"), "mlp.gate_up_proj": ("gate", "up")}
"""A fused transformers module's parts, as the stored model names them."""
_PLAIN = {
    f"{side}.{part}_proj": part
    for side, parts in (("self_attn", "qkvo"), ("mlp", ("gate", "up", "down")))
    for part in parts
}
"""A transformers module's stored name."""


def with_stored_matrices(model: Any, stored: StoredModel) -> Any:
    """``model`` (a family's transformers model) with every matrix replaced by ``stored``'s,
    dequantized (fused ones joined again): transformers' own forward over a file's weights."""
    w = {name: torch.from_numpy(t.float32()) for name, t in stored.tensors.items()}
    joined, plain = _JOINED, _PLAIN
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


def kernel_activations(x: torch.Tensor, size: int = 32, levels: float = 32767.0) -> torch.Tensor:
    """``x`` as sfnode's kernels see it (``quantize_row`` and its int8 kin in native.c): each
    block of ``size`` values scaled so that its largest magnitude is ``levels``, rounded to the
    nearest integer (ties to even), and scaled back by that largest magnitude / ``levels``."""
    blocks = x.to(torch.float32).reshape(*x.shape[:-1], -1, size)
    mx = blocks.abs().amax(-1, keepdim=True)
    scale = torch.where(mx > 0, torch.tensor(levels) / mx, torch.zeros_like(mx))
    q = torch.round(blocks * scale)
    return (q * (mx / levels)).reshape(x.shape)


def activation_rounding(kinds: set[str]) -> tuple[int, float]:
    """The block size and levels the kernels quantize the activations of a matrix of parts
    ``kinds`` to: int8 per 32 for Q5 blocks, per 256 for K-quants, else int16 per 32 (Q8_0
    blocks, Q4_0/Q4_1 tiles)."""
    if kinds <= set(PER_32):
        return 32, 127.0
    if kinds <= set(PER_256):
        return 256, 127.0
    if kinds & (set(PER_32) | set(PER_256)):
        raise ValueError(f"no one activation rounding for a matrix of {sorted(kinds)}")
    return 32, 32767.0


def with_kernel_activations(model: Any, stored: StoredModel) -> Any:
    """``model`` whose layers' matrices (not the head: the step computes its best logits again
    in float32) multiply as sfnode's quantized kernels do: a matrix whose parts the kernels
    multiply against int8 activations (Q5, K-quants) by :func:`block_product`, their integer
    math and float steps exactly; any other (Q8_0, Q4_0/Q4_1 tiles) over its activations
    rounded as the int16 kernels hold them (:func:`kernel_activations`), but for the order of
    the float sums."""
    for name, module in model.model.layers.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        index, stem = name.split(".", 1)
        parts = [stored.tensors[f"{index}.{part}"] for part in _JOINED.get(stem) or (_PLAIN[stem],)]
        size, levels = activation_rounding({t.kind for t in parts})
        if levels == 127.0:
            module.forward = _stored_product(parts, module.bias)
        else:
            module.register_forward_pre_hook(
                lambda _, args, s=size, v=levels: (kernel_activations(args[0], s, v),)
            )
    return model


def _stored_product(parts: list[Any], bias: torch.Tensor | None) -> Any:
    """A Linear's forward that multiplies ``parts`` (stored tensors, stacked) as the block
    kernels do, then adds ``bias``."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        flat = x.detach().reshape(-1, x.shape[-1]).to(torch.float32).numpy()
        y = np.concatenate([block_product(t.kind, t.data, t.cols, flat) for t in parts], 1)
        out = torch.from_numpy(y).reshape(*x.shape[:-1], -1)
        return out + bias if bias is not None else out

    return forward


# The block kernels' integer math, in NumPy (docs/engine.md section 5.4): the activations as
# the kernels quantize them and the products as they form them, every float rounding repeated.

PER_32 = ("Q5_0", "Q5_1")
"""Formats whose kernels read int8 activations with a scale per block of 32."""
PER_256 = ("Q4_K", "Q5_K", "Q6_K")
"""Formats whose kernels read int8 activations with a scale per 256 (Q8_K)."""
_SCALE_AT = {"Q5_0": 0, "Q5_1": 0, "Q4_K": 0, "Q5_K": 0, "Q6_K": 208}
"""Byte offset of each format's float16 d in its block (Q5_1's m and the K-quants' dmin follow
it, except Q6_K's, which has none)."""
_ONE, _ZERO = np.float16(1.0).view(np.uint16), np.float16(0.0).view(np.uint16)


def int8_blocks(x: np.ndarray[Any, Any], size: int) -> tuple[Any, Any]:
    """Rows ``x`` [M, K] as the kernels quantize them to int8: per block of ``size`` inputs
    (32, or 256 for Q8_K) q = round(x * (127 / amax)) (ties to even) and d = amax / 127 (all
    float32 steps); ``(q [M, K] int64, d [M, K / size] float32)``."""
    f = np.asarray(x, np.float32).reshape(x.shape[0], -1, size)
    mx = np.abs(f).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        scale = np.where(mx > 0, np.float32(127.0) / mx, np.float32(0.0)).astype(np.float32)
    q = np.rint(f * scale).astype(np.int64).reshape(x.shape)
    return q, (mx[..., 0] / np.float32(127.0)).astype(np.float32)


def _patched(kind: str, raw: np.ndarray[Any, Any], cols: int, d: Any, second: Any) -> Any:
    """The weights of ``raw`` with every block's d (and its second float16: Q5_1's m, a
    K-quant's dmin) replaced: with d = 1 and 0 the integers a kernel multiplies."""
    from sfnode.engines.kernels.blocks import FORMATS, dequantize

    size = FORMATS[kind].size
    blocks = np.array(raw, np.uint8).reshape(-1, size)
    at = _SCALE_AT[kind]
    blocks[:, at : at + 2] = np.frombuffer(np.uint16(d).tobytes(), np.uint8)
    if kind in ("Q5_1", "Q4_K", "Q5_K"):
        blocks[:, at + 2 : at + 4] = np.frombuffer(np.uint16(second).tobytes(), np.uint8)
    return dequantize(kind, blocks.reshape(raw.shape[0], -1), cols).astype(np.int64)


def _halves_at(raw: np.ndarray[Any, Any], kind: str, offset: int) -> Any:
    from sfnode.engines.kernels.blocks import FORMATS

    blocks = np.ascontiguousarray(raw).reshape(-1, FORMATS[kind].size)
    at = _SCALE_AT[kind] + offset
    return blocks[:, at : at + 2].copy().view(np.float16)[:, 0].astype(np.float32)


def _hsum8(acc: Any) -> Any:
    """native.c's hsum of 8 float lanes (the last axis), in its order."""
    r = [acc[..., i] + acc[..., i + 4] for i in range(4)]
    return (r[0] + r[2]) + (r[1] + r[3])


def block_product(kind: str, raw: np.ndarray[Any, Any], cols: int, x: Any) -> Any:
    """``x`` [M, cols] times the ``kind`` rows ``raw`` [N, bytes], float32 [M, N], as
    native.c's kernels compute it, bit for bit."""
    x = np.asarray(x, np.float32)
    rows = raw.shape[0]
    q = _patched(kind, raw, cols, _ONE, _ZERO)  # d * sc * q with d = 1: the integers
    d = _halves_at(raw, kind, 0).reshape(rows, -1)
    if kind in PER_32:
        xq, dx = int8_blocks(x, 32)
        nb = cols // 32
        # [M, N, block, lane]: lane i the inputs 4i..4i+3 of the block
        lanes = np.einsum("mbit,nbit->mnbi", xq.reshape(-1, nb, 8, 4), q.reshape(rows, nb, 8, 4))
        acc = np.zeros((x.shape[0], rows, 8), np.float32)
        plus = np.zeros((x.shape[0], rows), np.float32)
        m = _halves_at(raw, kind, 2).reshape(rows, -1) if kind == "Q5_1" else None
        sx = dx * xq.reshape(-1, nb, 32).sum(-1).astype(np.float32)
        for b in range(nb):
            ddx = (d[None, :, b] * dx[:, None, b]).astype(np.float32)
            acc = acc + lanes[:, :, b].astype(np.float32) * ddx[..., None]
            if m is not None:
                plus = plus + m[None, :, b] * sx[:, None, b]
        return (_hsum8(acc) + plus).astype(np.float32)
    xq, dx = int8_blocks(x, 256)
    nsb = cols // 256
    sums = np.einsum("msk,nsk->mns", xq.reshape(-1, nsb, 256), q.reshape(rows, nsb, 256))
    if kind == "Q6_K":
        mins, dmin = np.zeros_like(sums), np.zeros_like(d)
    else:
        negative = _patched(kind, raw, cols, _ZERO, _ONE)  # -m[j] for each weight
        mins = -np.einsum(
            "msk,nsk->mns", xq.reshape(-1, nsb, 256), negative.reshape(rows, nsb, 256)
        )
        dmin = _halves_at(raw, kind, 2).reshape(rows, -1)
    y = np.zeros((x.shape[0], rows), np.float32)
    for sb in range(nsb):
        a = (d[None, :, sb] * dx[:, None, sb]) * sums[:, :, sb].astype(np.float32)
        b = (dmin[None, :, sb] * dx[:, None, sb]) * mins[:, :, sb].astype(np.float32)
        y = (y + a) - b
    return y
