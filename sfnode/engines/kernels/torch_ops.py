"""Faster CPU matrix products for the engine's worker thread, and a KV cache that grows in place.

Two measured costs of a decode step on these CPUs (AMD EPYC, 2 cores, torch 2.13 with MKL), and
what this module does about them:

- ``torch.nn.functional.linear`` in float32 goes to MKL's ``sgemm``, which on this CPU reads the
  weights at about 5 GB/s for 2 to 16 rows (half its speed at one row); oneDNN's matmul
  (``torch.ops.mkldnn._linear_pointwise``, the kernel PyTorch's own inductor emits for CPU linear
  layers) runs the same products 1.3 to 1.8 times faster at every batch size from 1 to 200 rows.
  :func:`use_onednn_linear` routes a model's ``nn.Linear`` layers there, but only on the threads
  that opt in with :func:`onednn_on_this_thread` (the engine's worker), so anyone else calling the
  same model (``generate()`` in a test, a benchmark's baseline) still gets stock PyTorch.
- transformers' ``DynamicLayer`` appends each step's key and value with ``torch.cat``, copying the
  whole cache every step (about 8 ms of a 90 ms step at 8 lanes and 200 tokens).
  :class:`SlackLayer` writes new entries into spare room at the end of a buffer instead and
  regrows only when the room runs out.

Neither changes what is computed: the products are the same float32 products (summed in another
order, so results may differ in the last bits from MKL's), and the cache holds the same tensors.
This module must never change a model for threads that did not opt in, and never be required:
when oneDNN is missing or fails its self-check, everything runs on stock PyTorch.
"""

from __future__ import annotations

import threading
import types
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

_local = threading.local()

# Room added beyond what an append needs when a cache buffer regrows (tokens).
_SLACK_TOKENS = 64


def onednn_on_this_thread(enabled: bool = True) -> None:
    """Let (or stop letting) this thread's calls of patched layers use oneDNN."""
    _local.onednn = enabled


def _onednn_linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if getattr(_local, "onednn", False) and x.dtype == torch.float32:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x, self.weight, self.bias, "none", [], ""
        )
        return out
    return torch.nn.functional.linear(x, self.weight, self.bias)


def onednn_linear_works() -> bool:
    """Whether this torch build has oneDNN's linear kernel and it agrees with ``F.linear``."""
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(24, 40, generator=generator)
        bias = torch.randn(24, generator=generator)
        x = torch.randn(3, 5, 40, generator=generator)
        got = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    except (AttributeError, RuntimeError):
        return False
    want = torch.nn.functional.linear(x, weight, bias)
    return bool(got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-4))


def use_onednn_linear(model: Any) -> int:
    """Route the float32 CPU ``nn.Linear`` layers of ``model`` to oneDNN on opted-in threads.

    Returns how many layers were routed (0 when oneDNN is unavailable or the model is elsewhere).
    Calling it again is harmless.
    """
    if not onednn_linear_works():
        return 0
    routed = 0
    for module in model.modules():
        if (
            isinstance(module, torch.nn.Linear)
            and module.weight.device.type == "cpu"
            and module.weight.dtype == torch.float32
        ):
            module.forward = types.MethodType(  # type: ignore[method-assign]
                _onednn_linear_forward, module
            )
            routed += 1
    return routed


class SlackLayer(DynamicLayer):  # type: ignore[no-untyped-call]
    """A ``DynamicLayer`` that appends in place, into room kept at the end of its buffers.

    ``keys`` and ``values`` stay what transformers expects (``[batch, heads, length, head_dim]``),
    as views of the first ``length`` positions of larger buffers.  Code that assigns new tensors
    to ``keys`` and ``values`` (the engine does when lanes join and leave) is honoured: the next
    append notices that they are no longer views of the buffers and regrows from them.
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        self._keys_view: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = self.keys, self.values
        assert keys is not None and values is not None
        length = keys.shape[-2] if keys.dim() == 4 else 0
        need = length + key_states.shape[-2]
        if (
            self._key_buffer is None
            or self._value_buffer is None
            or keys is not self._keys_view
            or need > self._key_buffer.shape[-2]
            or self._key_buffer.shape[0] != key_states.shape[0]
        ):
            self._key_buffer = self._regrown(keys, key_states, length, need)
            self._value_buffer = self._regrown(values, value_states, length, need)
        self._key_buffer[:, :, length:need] = key_states
        self._value_buffer[:, :, length:need] = value_states
        self.keys = self._key_buffer[:, :, :need]
        self.values = self._value_buffer[:, :, :need]
        self._keys_view = self.keys
        return self.keys, self.values

    @staticmethod
    def _regrown(old: torch.Tensor, new: torch.Tensor, length: int, need: int) -> torch.Tensor:
        batch, heads, _, head_dim = new.shape
        buffer = new.new_empty((batch, heads, need + _SLACK_TOKENS, head_dim))
        if length:
            buffer[:, :, :length] = old
        return buffer


def lane_cache(config: Any) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` whose full-attention layers are :class:`SlackLayer`."""
    cache = DynamicCache(config=config)
    cache.layers = [
        SlackLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers
    ]
    return cache
