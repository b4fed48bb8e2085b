"""A warm start reads what the first start of a file kept, and nothing kept for another file or
another engine; the start-up check of exactness runs off the path to the first token and a
failure withdraws the node (docs/engine.md section 4.1).

- What is kept beside a file's model files (packed weights, the kernels' self-checks, the
  check's digest) is read at the next start with the same engine, and never by another engine
  (:func:`sfnode.engines.weights.packed.engine_version`) or for a changed file (another
  folder).
- An engine whose check computes other keys, values or logits than the file's first start did
  (its kept digest damaged) refuses all work.
- A real ``twistd sfnode`` on the bundled model whose kept digest is damaged serves no model to
  a real ``twistd sfhead``: the head reads the refusal in HELLO_ACK_F (D25) and shows it in its
  ``/metrics``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from twisted.internet import reactor
from twisted.trial import unittest
from twisted.web.client import Agent, readBody

from sfnode.engines import transformers_engine
from sfnode.engines.config import EngineConfig
from sfnode.engines.kernels.choice import Choice
from sfnode.engines.transformers_engine import TransformersEngine
from sfnode.engines.weights import packed
from sfnode.generation import EngineRefusal, GenerationRequest
from sfnode.linkf.model_cache import gguf_cache_folder
from sfnode.linkf.wire import GenParams
from tests.bundled import BUNDLED_MODEL_SKIP
from tests.processes import LOOPBACK, Child, loopback_head, node_endpoint, spawn_twistd, spawner
from tests.tinymodel import tiny_llama

_MODELS: dict[str, Any] = {}


def model() -> Any:
    if "model" not in _MODELS:
        _MODELS["model"] = tiny_llama(window=256)
    return _MODELS["model"]


class KeptResultsTests(unittest.TestCase):
    """What a start keeps for the next one, and who may read it."""

    def engine(self, cache: Path) -> TransformersEngine:
        """An engine over the tiny model whose int4 weights (torch's kernels: converted, so
        kept) and check are kept beside ``cache``; the check begins at once, not after
        :data:`~sfnode.engines.transformers_engine.CHECK_AFTER_S` without a request."""
        self.patch(transformers_engine, "CHECK_AFTER_S", 0.0)
        config = EngineConfig(
            max_lanes=2, weights="int4", kernels="torch", weights_cache=cache, interactive_lanes=0
        )
        engine = TransformersEngine(model(), reactor, config)
        engine.start()
        self.addCleanup(engine.stop)
        return engine

    def saves(self) -> list[Path]:
        """The packed-weights files written from now on."""
        written: list[Path] = []
        save = packed.save

        def recording(path: Path, *args: Any) -> None:
            written.append(path)
            save(path, *args)

        self.patch(packed, "save", recording)
        return written

    async def test_a_warm_start_reads_the_packed_weights_and_the_checks_digest(self) -> None:
        """The first start packs the weights, keeps them and its check's digest; the next one
        with the same engine packs nothing, and its check passes against the kept digest."""
        cache = Path(self.mktemp()) / "packed-weights.safetensors"
        written = self.saves()
        first = self.engine(cache)
        self.assertIsNone(await first.exactness)
        self.assertEqual(written, [cache])
        kept = json.loads((cache.parent / packed.EXACTNESS_FILE).read_text())
        self.assertEqual(len(kept), 1)
        second = self.engine(cache)
        self.assertIsNone(await second.exactness)
        self.assertEqual(written, [cache], "the warm start packed the weights again")
        self.assertEqual(json.loads((cache.parent / packed.EXACTNESS_FILE).read_text()), kept)
        self.assertIsNone(second.refusal)

    async def test_another_engine_reads_nothing_the_first_kept(self) -> None:
        """With another engine version, the packed weights are packed again and the check
        keeps a digest of its own beside the first one."""
        cache = Path(self.mktemp()) / "packed-weights.safetensors"
        written = self.saves()
        self.assertIsNone(await self.engine(cache).exactness)
        self.patch(packed, "engine_version", lambda: "another-engine")
        self.assertIsNone(await self.engine(cache).exactness)
        self.assertEqual(written, [cache, cache])
        kept = json.loads((cache.parent / packed.EXACTNESS_FILE).read_text())
        self.assertEqual(len(kept), 2)
        self.assertEqual(sum("another-engine" in key for key in kept), 1)

    def test_packed_weights_of_another_engine_are_not_read(self) -> None:
        """The packed file's signature names the engine: a file packed by another engine is
        not read."""
        import torch

        from sfnode.engines.kernels.quant import Int4Linear, Precision

        linears = {"a": Int4Linear.quantize(torch.randn(64, 64))}
        wanted = {"a": Precision.INT4}
        checks: dict[Precision, str | None] = {p: None for p in Precision}
        path = Path(self.mktemp()) / "packed.safetensors"
        signature, _ = packed.signature("int4", checks, Choice("torch", "asked for"), path)
        packed.save(path, signature, wanted, linears)  # type: ignore[arg-type]
        self.assertIsNotNone(packed.load(path, wanted, signature))
        self.patch(packed, "engine_version", lambda: "another-engine")
        other, _ = packed.signature("int4", checks, Choice("torch", "asked for"), path)
        self.assertIsNone(packed.load(path, wanted, other))

    def test_kernel_checks_of_another_engine_are_run_again(self) -> None:
        """The kernels' self-checks kept by one engine are read by it and run again by
        another."""
        folder = Path(self.mktemp())
        folder.mkdir()
        runs: list[int] = []
        usable = packed.usable_precisions

        def counting() -> Any:
            runs.append(1)
            return usable()

        self.patch(packed, "usable_precisions", counting)
        packed.cached_precisions(folder)
        packed.cached_precisions(folder)
        self.assertEqual(len(runs), 1)
        self.patch(packed, "engine_version", lambda: "another-engine")
        packed.cached_precisions(folder)
        self.assertEqual(len(runs), 2)

    def test_a_changed_file_has_another_folder(self) -> None:
        """Everything kept for a GGUF file lies in a folder named by its content: the same
        bytes find the same folder, a changed byte another one."""
        root = Path(self.mktemp())
        root.mkdir()
        gguf = root / "m.gguf"
        gguf.write_bytes(b"GGUF" + bytes(4096))
        first = gguf_cache_folder(gguf, root / "cache")
        self.assertEqual(gguf_cache_folder(gguf, root / "cache"), first)
        gguf.write_bytes(b"GGUF" + bytes(4095) + b"\x01")
        self.assertNotEqual(gguf_cache_folder(gguf, root / "cache"), first)

    async def test_a_check_that_differs_from_the_kept_one_withdraws_the_engine(self) -> None:
        """When the kept digest is not what the check computes (a damaged cache), the check
        fails and the engine refuses every generation from then on."""
        cache = Path(self.mktemp()) / "packed-weights.safetensors"
        self.assertIsNone(await self.engine(cache).exactness)
        path = cache.parent / packed.EXACTNESS_FILE
        kept = json.loads(path.read_text())
        path.write_text(json.dumps({key: "0" * 64 for key in kept}))
        engine = self.engine(cache)
        problem = await engine.exactness
        assert problem is not None
        self.assertIn("first start", problem)
        self.assertEqual(engine.refusal, problem)
        handle = engine.submit(GenerationRequest([5, 6, 7], GenParams(), 4, 0), lambda *_: None)
        with self.assertRaises(EngineRefusal):
            await handle.result

    async def test_dense_copies_chosen_for_long_chunks_withdraw_nothing(self) -> None:
        """An engine whose weights keep dense copies for chunks of two rows or more (a
        configuration that gives up a position's KV being independent of its chunk, docs/engine.md
        section 5) is not withdrawn by the check's split: the check passes, the kept digest is
        written, and the engine serves."""
        cache = Path(self.mktemp()) / "packed-weights.safetensors"
        self.patch(transformers_engine, "CHECK_AFTER_S", 0.0)
        config = EngineConfig(
            max_lanes=2, weights="int4", kernels="torch", weights_cache=cache, interactive_lanes=0
        )
        engine = TransformersEngine(model(), reactor, config)
        weights = engine.weights.runner.weights
        for layer in weights.layers:
            layer.qkv, layer.o = layer.qkv.with_dense(), layer.o.with_dense()
            layer.gate_up, layer.down = layer.gate_up.with_dense(), layer.down.with_dense()
        weights.dense_rows = 2
        engine.start()
        self.addCleanup(engine.stop)
        self.assertIsNone(await engine.exactness)
        self.assertIsNone(engine.refusal)
        self.assertTrue((cache.parent / packed.EXACTNESS_FILE).is_file())
        handle = engine.submit(GenerationRequest([5, 6, 7], GenParams(), 4, 0), lambda *_: None)
        self.assertEqual(len((await handle.result).tokens), 4)


class WithdrawnNodeTests(unittest.TestCase):
    """A real node whose start-up check fails, and a real head (docs/engine.md section 4.1)."""

    skip = BUNDLED_MODEL_SKIP
    timeout = 600

    async def test_a_node_whose_check_fails_serves_no_model_to_its_head(self) -> None:
        """A node on the bundled model started on a cache whose kept digest was damaged
        listens, fails its check and withdraws; the head that dials it then reads the
        refusal in HELLO_ACK_F: it logs the node as joined refusing its model, and
        ``sfhead_node_refused`` names the node with the check's reason."""
        cache = Path(self.mktemp()).resolve()  # the node runs in a folder of its own
        args = ["sfnode", "--listen", LOOPBACK, "--threads", "2", "--cache-dir", str(cache)]
        first = spawn_twistd(self, Child("sfnode"), args)
        await first.wait_for(rb"checked: a position's KV")
        await first.kill()
        (kept,) = list(cache.glob(f"*/{packed.EXACTNESS_FILE}"))
        kept.write_text(json.dumps({key: "0" * 64 for key in json.loads(kept.read_text())}))
        node = spawn_twistd(self, Child("sfnode"), args)
        endpoint = await node_endpoint(node)
        await node.wait_for(rb"the start-up check of exactness failed")
        await node.wait_for(rb"the node withdrew")
        head, base = await loopback_head(spawner(self), nodes=[endpoint])
        await head.wait_for(rb"joined \([^)]*\) refusing its model: [^\n]*first start")
        url = f"{base}/metrics".encode()
        response = await Agent(reactor).request(b"GET", url)
        text = (await readBody(response)).decode()
        refused = [
            sample
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "sfhead_node_refused"
        ]
        self.assertEqual(len(refused), 1, text)
        self.assertIn("first start", refused[0].labels["reason"])
