"""``/v1/embeddings`` on the head (issue 33 item 3; docs/api.md "/v1/embeddings",
docs/protocol.md section 12.7).

In memory (tests/memoryhead.py): nodes whose engine embeds with a pretend model
(tests/embedders.py ``HashEmbedder``: every vector known from its text) beside a generating
node, behind the whole head, so each answer is compared with the vectors the texts must get;
the placement (embedding nodes only, chunks of 64 spread over them, another node asked when
one refuses), the answer's shapes and every refusal.  Over real TCP, all-MiniLM-L6-v2 behind a
head, asked with the ``openai`` package (base64, its default, and float).
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Generator
from typing import Any

import numpy as np
from twisted.internet import defer, reactor, threads

from tests.clients import openai_client
from tests.embedders import HASH_DIM, MINILM_SKIP, HashEmbedder, hash_vector, minilm_folder
from tests.memoryhead import MemoryHead, MemoryHeadTestCase
from tests.test_http import MODEL, HttpTestCase, record_ends, tokenizer

CHATTY = "chatty"
"""The generating model beside the embedding one (``MODEL``)."""


class EmbeddingFleetTestCase(MemoryHeadTestCase):
    """A head over embedding nodes and a generating one, in memory."""

    def fleet(self, embedders: int = 1) -> tuple[MemoryHead, list[HashEmbedder], Any]:
        """A head over ``embedders`` embedding nodes serving ``MODEL`` and one mock node
        generating with ``CHATTY``."""
        engines = [HashEmbedder(self.reactor) for _ in range(embedders)]
        for i, engine in enumerate(engines):
            self.start_mock_node(f"embed-{i}", engine=engine, model_name=MODEL)
        self.start_mock_node("chat", model_name=CHATTY)
        head = self.start_head()
        head.api.models.serve(CHATTY, tokenizer(), origin="the test", override=True)
        self.until(lambda: len(head.fleet.live_nodes()) == embedders + 1)
        return head, engines, head.fleet

    def post(self, head: MemoryHead, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        status, content = self.call(head, b"POST", path, body)
        return status, json.loads(content)


class EmbeddingsTests(EmbeddingFleetTestCase):
    def test_float_and_base64_answers(self) -> None:
        """Each input gets its vector, in order, as JSON numbers or as the base64 of its
        little-endian float32 bytes; ``usage`` counts the node's tokens."""
        head, (engine,), _ = self.fleet()
        texts = ["the fox", "jumps", "over the lazy dog"]
        status, answer = self.post(head, "/v1/embeddings", {"model": MODEL, "input": texts})
        self.assertEqual(status, 200)
        self.assertEqual((answer["object"], answer["model"]), ("list", MODEL))
        self.assertEqual([d["index"] for d in answer["data"]], [0, 1, 2])
        np.testing.assert_array_equal(
            [d["embedding"] for d in answer["data"]], [hash_vector(t) for t in texts]
        )
        self.assertEqual(answer["usage"], {"prompt_tokens": 7, "total_tokens": 7})
        body = {"model": MODEL, "input": "the fox", "encoding_format": "base64"}
        status, coded = self.post(head, "/v1/embeddings", body)
        raw = base64.b64decode(coded["data"][0]["embedding"])
        self.assertEqual(list(struct.unpack(f"<{HASH_DIM}f", raw)), hash_vector("the fox"))
        self.assertEqual(engine.calls, [tuple(texts), ("the fox",)])

    def test_many_inputs_go_in_chunks_spread_over_the_embedding_nodes(self) -> None:
        """150 inputs go as EMBED_REQ of 64, 64 and 22 texts, spread over the two embedding
        nodes (the one with fewer outstanding first), never to the generating node; the
        answer keeps the inputs' order."""
        head, engines, _ = self.fleet(embedders=2)
        texts = [f"text {i}" for i in range(150)]
        status, answer = self.post(head, "/v1/embeddings", {"model": MODEL, "input": texts})
        self.assertEqual(status, 200)
        np.testing.assert_array_equal(
            [d["embedding"] for d in answer["data"]], [hash_vector(t) for t in texts]
        )
        asked = sorted((len(c) for e in engines for c in e.calls), reverse=True)
        self.assertEqual(asked, [64, 64, 22])
        self.assertTrue(all(e.calls for e in engines))

    def test_a_refusing_node_is_replaced_and_none_left_is_503(self) -> None:
        """A node that refuses (nil vectors) is replaced by another embedding node for the
        same texts; with every embedding node refusing the answer is a 503 naming the
        model's node."""
        head, (first, second), _ = self.fleet(embedders=2)
        first.fail = True
        status, answer = self.post(head, "/v1/embeddings", {"model": MODEL, "input": "a"})
        self.assertEqual(status, 200)
        self.assertEqual(answer["data"][0]["embedding"], hash_vector("a"))
        self.assertEqual((first.calls, second.calls), ([("a",)], [("a",)]))
        second.fail = True
        status, answer = self.post(head, "/v1/embeddings", {"model": MODEL, "input": "a"})
        self.assertEqual(status, 503)
        self.assertIn("refused the embedding", answer["error"]["message"])

    def test_refusals(self) -> None:
        """``dimensions``, token arrays, an empty input, an unknown field or model, and a
        generating model are refused naming the field; a completion naming the embedding
        model is a 400 pointing to /v1/embeddings; no node embedded or generated."""
        head, (engine,), _ = self.fleet()
        generated = record_ends(engine)
        cases = [
            ({"input": "a", "dimensions": 4}, 400, "dimensions"),
            ({"input": [1, 2, 3]}, 400, "input"),
            ({"input": [[1, 2]]}, 400, "input"),
            ({"input": []}, 400, "input"),
            ({"input": ""}, 400, "input"),
            ({"input": "a", "encoding_format": "int8"}, 400, "encoding_format"),
            ({"input": "a", "frobnicate": 1}, 400, "frobnicate"),
            ({"input": "a", "model": "nope"}, 404, "model"),
            ({"input": "a", "model": CHATTY}, 400, "model"),
        ]
        for extra, status, param in cases:
            got, answer = self.post(head, "/v1/embeddings", {"model": MODEL, **extra})
            self.assertEqual((got, answer["error"]["param"]), (status, param), extra)
        status, answer = self.post(
            head, "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )  # fmt: skip
        self.assertEqual((status, answer["error"]["code"]), (400, "model_not_generative"))
        self.assertEqual(engine.calls, [])
        self.assertEqual(generated, [])

    def test_models_say_which_embed_and_generation_avoids_embedding_nodes(self) -> None:
        """``/v1/models`` marks the embedding model (``capabilities.embeddings``, not chat)
        and the generating one; a chat completion of the generating model is served by its
        node, never placed on an embedding node."""
        head, (engine,), _ = self.fleet()
        generated = record_ends(engine)
        status, content = self.call(head, b"GET", "/v1/models")
        entries = {e["id"]: e for e in json.loads(content)["data"]}
        self.assertEqual(entries[MODEL]["capabilities"],
                         {"chat": False, "completions": False, "embeddings": True,
                          "vision": False})  # fmt: skip
        self.assertEqual(entries[MODEL]["nodes"], 1)
        self.assertEqual(entries[CHATTY]["capabilities"]["embeddings"], False)
        self.assertEqual(entries[CHATTY]["capabilities"]["chat"], True)
        status, answer = self.post(
            head, "/v1/chat/completions",
            {"model": CHATTY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )  # fmt: skip
        self.assertEqual((status, answer["model"]), (200, CHATTY))
        self.assertEqual(generated, [])


class MiniLMOverHttpTests(HttpTestCase):
    """all-MiniLM-L6-v2 behind a head over real TCP, asked with the ``openai`` package."""

    skip = MINILM_SKIP

    @defer.inlineCallbacks
    def test_the_openai_client_gets_the_models_vectors(
        self,
    ) -> Generator[defer.Deferred[Any], Any, None]:
        """``client.embeddings.create`` (base64, which the package asks by default and
        decodes itself, and float) answers
        the engine's own vectors for each input, in order, 384 long; ``dimensions`` is a
        400 the package raises as BadRequestError."""
        import openai

        from sfnode.engines.embedding import EmbeddingEngine
        from sfnode.node.agent import NodeAgent
        from sfnode.node.config import NodeConfig

        engine = EmbeddingEngine.from_folder(reactor, minilm_folder())
        agent = NodeAgent(reactor, engine, NodeConfig(identity="minilm", model_name="minilm"))
        node = yield self.serve(agent, engine)
        head = yield self.start_head([node])
        client = openai_client(self, head.base + "/v1")
        texts = ["A man is eating food.", "The girl is carrying a baby."]
        expected = yield engine.embed(texts)
        vectors = np.frombuffer(expected.vectors, "<f4").reshape(2, 384)
        for extra in ({}, {"encoding_format": "float"}):
            answer = yield threads.deferToThread(
                lambda e=extra: client.embeddings.create(model="minilm", input=texts, **e)
            )
            got = np.array([d.embedding for d in answer.data], dtype=np.float32)
            np.testing.assert_array_equal(got, vectors)
            self.assertEqual(answer.usage.prompt_tokens, expected.tokens)
        with self.assertRaises(openai.BadRequestError):
            yield threads.deferToThread(
                lambda: client.embeddings.create(model="minilm", input="a", dimensions=8)
            )
