"""Two models behind one ``twistd sfhead`` started without ``--model``, as real processes on
loopback: the nodes (mock engines given a tokenizer folder with ``--model``) dial in and send
their model files (docs/protocol.md section 12.5); each chat is rendered with its own model's
template; a node of one model killed mid-stream fails over to the other node of that model,
never to the node of the other model.

The two tokenizer folders hold the bundled model's tokenizer (saved by transformers from the
GGUF, so the mock engines' ids are all in its vocabulary), one with its own chat template and
one with another.  No sleeps: every wait is on a line a process logs or on the HTTP stream.
"""

from __future__ import annotations

import json
import re
from collections.abc import Generator
from io import BytesIO
from pathlib import Path
from typing import Any

from twisted.internet import defer, reactor
from twisted.trial.unittest import SkipTest, TestCase
from twisted.web.client import Agent, FileBodyProducer, readBody
from twisted.web.http_headers import Headers

from sfnode.head.models.chat import ChatMessage
from sfnode.head.models.text import HeadTokenizer, Renderer
from tests.processes import LOOPBACK, Child, spawn_twistd
from tests.test_fleet_process import _Stream

TEMPLATE_B = (
    "{% for m in messages %}### {{ m.role }} says:\n{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant says:\n{% endif %}"
)
MESSAGES = [{"role": "user", "content": "name three colours"}]


def bundled_tokenizer_folders(root: Path) -> tuple[Path, Path]:
    """Two folders with the bundled model's tokenizer: ``a`` with its own chat template,
    ``b`` with :data:`TEMPLATE_B`."""
    from sfnode.engines.weights import loading

    try:
        tokenizer = loading.load_tokenizer(None)
    except loading.ModelLoadError as e:
        raise SkipTest(f"the bundled model is not installed: {e}") from e
    folders = root / "a", root / "b"
    for folder in folders:
        tokenizer.save_pretrained(str(folder))
    (folders[1] / "chat_template.jinja").write_text(TEMPLATE_B)
    return folders


class TwoModelProcessTests(TestCase):
    timeout = 120

    def spawn(self, name: str, args: list[str]) -> Child:
        return spawn_twistd(self, Child(name), args)

    @defer.inlineCallbacks
    def test_two_models_from_node_files_with_failover_within_a_model(
        self,
    ) -> Generator[Any, Any, None]:
        """A head with no --model serves tiny-a (two nodes) and tiny-b (one node) from the
        files they send: /v1/models lists both with their node counts; a tiny-b chat is
        rendered with tiny-b's template; a tiny-a stream whose node is killed completes from
        the other tiny-a node with the text of an uninterrupted run, and the tiny-b node
        decoded nothing for it; the head never maps libtorch."""
        folder_a, folder_b = bundled_tokenizer_folders(Path(self.mktemp()).resolve())
        head = self.spawn("head", ["sfhead", "--http", LOOPBACK, "--fleet-listen", LOOPBACK,
                                   "--policy", "least-loaded"])  # fmt: skip
        found = yield head.wait_for(rb"sfhead serving HTTP on 127\.0\.0\.1:(\d+)\n")
        base = f"http://127.0.0.1:{int(found[0].group(1))}"
        found = yield head.wait_for(rb"sfhead accepting nodes on 127\.0\.0\.1:(\d+)\n")
        join = f"127.0.0.1:{int(found[0].group(1))}"
        nodes = {}
        for identity, model, folder in (
            ("a0", "tiny-a", folder_a), ("b0", "tiny-b", folder_b), ("a1", "tiny-a", folder_a),
        ):  # fmt: skip
            nodes[identity] = self.spawn(
                identity,
                ["sfnode", "--join", join, "--engine", "mock", "--model", str(folder),
                 "--model-name", model, "--identity", identity, "--token-delay-ms", "25",
                 "--metrics", LOOPBACK],
            )  # fmt: skip
            # One at a time: least-loaded places the first tiny-a stream on a0, and a placement
            # that ignored the model would fail it over to b0 (registered before a1).
            yield head.wait_for(rf"node {identity} joined".encode())
        yield head.wait_for(rb"installed the model files", 2)
        metrics = {}
        for identity, node in nodes.items():
            metrics[identity] = yield node.wait_for(rb"sfnode metrics on 127\.0\.0\.1:(\d+)\n")
        agent = Agent(reactor)

        def call(method: bytes, path: str, body: Any = None) -> defer.Deferred[Any]:
            producer = FileBodyProducer(BytesIO(json.dumps(body).encode())) if body else None
            return agent.request(
                method,
                (base + path).encode(),
                Headers({b"content-type": [b"application/json"]}),
                producer,
            )

        response = yield call(b"GET", "/v1/models")
        listed = {m["id"]: m["nodes"] for m in json.loads((yield readBody(response)))["data"]}
        self.assertEqual((listed["tiny-a"], listed["tiny-b"]), (2, 1))

        request = {"model": "tiny-a", "prompt": list(range(100, 112)), "max_tokens": 100,
                   "seed": 1234}  # fmt: skip
        response = yield call(b"POST", "/v1/completions", request)
        reference = json.loads((yield readBody(response)))
        self.assertEqual(reference["usage"]["completion_tokens"], 100)
        response = yield call(b"POST", "/v1/completions", {**request, "stream": True})
        self.assertEqual(response.code, 200)
        stream = _Stream(3)
        response.deliverBody(stream)
        yield stream.content
        yield nodes["a0"].kill()
        body = yield stream.done
        events = [
            json.loads(line[len(b"data: ") :])
            for line in body.split(b"\n")
            if line.startswith(b"data: {")
        ]
        self.assertEqual(
            "".join(e["choices"][0]["text"] for e in events), reference["choices"][0]["text"]
        )
        self.assertIn(b"fails over from a0", bytes(head.output))
        decoded = {}
        for identity in ("a1", "b0"):
            port = int(metrics[identity][0].group(1))
            response = yield agent.request(b"GET", f"http://127.0.0.1:{port}/metrics".encode())
            text = yield readBody(response)
            found = re.search(rb"(?m)^sfnode_decoded_tokens_total\{[^}]*\} (\S+)$", text)
            assert found is not None, text
            decoded[identity] = float(found.group(1))
        self.assertGreater(decoded["a1"], 0.0)
        self.assertEqual(decoded["b0"], 0.0)

        response = yield call(
            b"POST", "/v1/chat/completions",
            {"model": "tiny-b", "messages": MESSAGES, "max_tokens": 4},
        )  # fmt: skip
        answer = json.loads((yield readBody(response)))
        self.assertEqual(response.code, 200, answer)
        prompt = Renderer(HeadTokenizer(folder_b)).chat(
            [ChatMessage(m["role"], m["content"]) for m in MESSAGES]
        )
        other = Renderer(HeadTokenizer(folder_a)).chat(
            [ChatMessage(m["role"], m["content"]) for m in MESSAGES]
        )
        self.assertNotEqual(len(prompt), len(other))
        self.assertEqual(answer["usage"]["prompt_tokens"], len(prompt))
        self.assertNotIn(b"Traceback", bytes(head.output))
        maps = Path(f"/proc/{head.transport.pid}/maps")
        if maps.exists():  # the head read two models' files and still never loaded torch
            self.assertNotIn(b"libtorch", maps.read_bytes())
