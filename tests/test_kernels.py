"""Tests of sfnode.engines.kernels.torch_ops: oneDNN linear layers on opted-in threads, in-place KV
growth.

They run real torch kernels on a tiny random Llama built from a config (nothing is downloaded) and
look at which operators ran with a torch dispatch mode.  They must never sleep.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer
from twisted.trial import unittest

from sfnode.engines.kernels.torch_ops import (
    SlackLayer,
    lane_cache,
    onednn_linear_works,
    onednn_on_this_thread,
    use_onednn_linear,
)
from tests.tinymodel import tiny_llama

T = TypeVar("T")

ONEDNN_OP = "mkldnn._linear_pointwise"


class OpRecorder(TorchDispatchMode):
    """Records the name of every torch operator that runs on this thread while active."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.add(func.overloadpacket._qualified_op_name.replace("::", "."))
        return func(*args, **(kwargs or {}))


def on_thread(f: Callable[[], T]) -> T:
    """Run ``f`` on a fresh thread (so thread-local opt-ins start clean) and return its result."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(("ok", f()))
        except BaseException as e:
            box.append(("error", e))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    kind, value = box[0]
    if kind == "error":
        raise value
    result: T = value
    return result


def forward_with_ops(model: Any, ids: torch.Tensor, opt_in: bool) -> tuple[torch.Tensor, set[str]]:
    """Logits of one forward on a new thread, and the names of the torch ops it ran; the thread
    opts in first when ``opt_in`` says so, and otherwise leaves the default alone."""

    def run() -> tuple[torch.Tensor, set[str]]:
        if opt_in:
            onednn_on_this_thread()
        with torch.inference_mode(), OpRecorder() as recorder:
            logits = model(input_ids=ids).logits
        return logits, recorder.names

    return on_thread(run)


class OneDNNLinearTests(unittest.SynchronousTestCase):
    """Only threads that opt in run a routed model's linear layers on oneDNN."""

    def setUp(self) -> None:
        if not onednn_linear_works():
            raise unittest.SkipTest("this torch build has no working oneDNN linear kernel")

    def test_every_float32_linear_layer_is_routed(self) -> None:
        """use_onednn_linear routes each nn.Linear of a float32 CPU model, and says how many."""
        model = tiny_llama()
        linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
        self.assertEqual(use_onednn_linear(model), linears)
        self.assertGreater(linears, 0)

    def test_half_precision_layers_stay_stock(self) -> None:
        """bfloat16 layers are left alone (PyTorch already sends them to oneDNN itself)."""
        model = tiny_llama().to(torch.bfloat16)
        self.assertEqual(use_onednn_linear(model), 0)

    def test_only_opted_in_threads_use_onednn(self) -> None:
        """An opted-in thread runs oneDNN's kernel; any other thread gets stock PyTorch; the
        logits agree to float32 rounding."""
        model = tiny_llama()
        use_onednn_linear(model)
        ids = torch.tensor([[5, 17, 99, 3, 250, 41]])
        fast, fast_ops = forward_with_ops(model, ids, opt_in=True)
        stock, stock_ops = forward_with_ops(model, ids, opt_in=False)
        self.assertIn(ONEDNN_OP, fast_ops)
        self.assertNotIn(ONEDNN_OP, stock_ops)
        torch.testing.assert_close(fast, stock, rtol=1e-4, atol=1e-4)

    def test_opting_out_again(self) -> None:
        """A thread that opted in and then out is back on stock PyTorch."""
        model = tiny_llama()
        use_onednn_linear(model)

        def run() -> set[str]:
            onednn_on_this_thread(True)
            onednn_on_this_thread(False)
            with torch.inference_mode(), OpRecorder() as recorder:
                model(input_ids=torch.tensor([[5, 6, 7]]))
            return recorder.names

        self.assertNotIn(ONEDNN_OP, on_thread(run))

    def test_unrouted_model_ignores_the_opt_in(self) -> None:
        """Opting in changes nothing for a model that was never routed."""
        _, ops = forward_with_ops(tiny_llama(), torch.tensor([[5, 6, 7]]), opt_in=True)
        self.assertNotIn(ONEDNN_OP, ops)


class SlackLayerTests(unittest.SynchronousTestCase):
    """SlackLayer holds exactly what DynamicLayer holds, without copying on every append."""

    def kv(self, batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        shape = (batch, 2, length, 8)
        return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)

    def test_appends_equal_dynamic_layer(self) -> None:
        """Appends of 1 to 70 tokens leave the same keys and values as torch.cat would."""
        slack, dynamic = SlackLayer(), DynamicLayer()
        for i, length in enumerate([37, 1, 1, 70, 1, 5, 64, 1]):
            k, v = self.kv(3, length, seed=i)
            got = slack.update(k, v)
            want = dynamic.update(k, v)
            self.assertTrue(torch.equal(got[0], want[0]))
            self.assertTrue(torch.equal(got[1], want[1]))
            self.assertEqual(slack.get_seq_length(), dynamic.get_seq_length())

    def test_single_token_appends_reuse_the_buffer(self) -> None:
        """One-token appends write into spare room: the storage stays the same."""
        layer = SlackLayer()
        layer.update(*self.kv(2, 10, seed=1))
        assert layer.keys is not None
        storage = layer.keys.untyped_storage().data_ptr()
        for i in range(20):
            layer.update(*self.kv(2, 1, seed=2 + i))
            self.assertEqual(layer.keys.untyped_storage().data_ptr(), storage)
        self.assertEqual(layer.get_seq_length(), 30)

    def test_assigned_tensors_are_adopted(self) -> None:
        """Keys and values assigned from outside (lanes joining or leaving) are what the next
        append extends, also when the batch size changed."""
        layer = SlackLayer()
        layer.update(*self.kv(3, 12, seed=1))
        k0, v0 = self.kv(2, 9, seed=2)
        layer.keys, layer.values = k0.clone(), v0.clone()
        k1, v1 = self.kv(2, 1, seed=3)
        keys, values = layer.update(k1, v1)
        self.assertTrue(torch.equal(keys, torch.cat([k0, k1], dim=-2)))
        self.assertTrue(torch.equal(values, torch.cat([v0, v1], dim=-2)))

    def test_lane_cache_gives_the_same_logits(self) -> None:
        """A model decoding with lane_cache produces the logits it produces with DynamicCache."""
        model = tiny_llama()
        cache = lane_cache(model.config)
        self.assertTrue(all(isinstance(layer, SlackLayer) for layer in cache.layers))
        reference = DynamicCache(config=model.config)
        ids = torch.tensor([[5, 17, 99, 3, 250, 41, 7]])
        with torch.inference_mode():
            for step in range(5):
                a = model(input_ids=ids, cache=cache, use_cache=True).logits[:, -1]
                b = model(input_ids=ids, cache=reference, use_cache=True).logits[:, -1]
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=f"step {step}")
                ids = a.argmax(-1, keepdim=True)
        self.assertEqual(cache.get_seq_length(), reference.get_seq_length())
