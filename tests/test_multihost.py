"""A fleet across machines: real ``twistd`` processes in network namespaces on one bridge.

Each test makes its own hosts (tests/netns.py: a namespace per host, ``eth0`` on a bridge, real
multicast between them) and runs a head and mock-engine nodes in them as an operator would:
the head's token made by ``python -m sfnode token`` and the nodes given only the value it
printed; one node joins with ``--join auto`` (DNS-SD on the bridge, no address given), one with
the head's address, one holds another fleet token; a head started without ``--model`` serves
two models from the files their nodes send.  The test reaches the head's HTTP API through a
Unix socket in a temporary folder (every namespace shares the file system, and nothing is added
to the machine's own network).  No sleeps: every wait is on a line a process logs or on an HTTP
answer.  Skipped, with the reason, where namespaces cannot be made (not root, no iproute2, a
container without the privilege) or zeroconf is missing.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from io import BytesIO
from pathlib import Path
from typing import Any

from twisted.internet import reactor
from twisted.internet.endpoints import UNIXClientEndpoint
from twisted.trial.unittest import SkipTest, TestCase
from twisted.web.client import Agent, FileBodyProducer, readBody
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgentEndpointFactory
from zope.interface import implementer

from sfnode.engines.mock import MOCK_VOCAB_SIZE
from tests import netns
from tests.processes import Child, child_env

FLEET_PORT = 8455
"""The head's fleet port: a fixed port is safe here, each host is a network of its own."""
RESTART_TARGET_S = 10.0
"""Both nodes back and answering within this many seconds of the new head's HTTP port opening
(issue 22's target; the nodes redial within 2 s and re-browse after 3 failed dials)."""


def mock_tokenizer(folder: Path, template: str | None = None) -> Path:
    """A tokenizer folder whose vocabulary holds every id the mock engine emits (the head
    detokenizes them): one word per id, written with the tokenizers package in well under a
    second, so the head starts without torch or a model; ``template`` is its chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(
        models.WordLevel({f"w{i}": i for i in range(MOCK_VOCAB_SIZE)}, unk_token="w0")
    )
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir(parents=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w2"}))
    if template is not None:
        (folder / "chat_template.jinja").write_text(template)
    return folder


TEMPLATES = {
    "m1": "{% for m in messages %}w10 {{ m.content }} w11 {% endfor %}w12",
    "m2": "w20 w21 {% for m in messages %}{{ m.content }} w22 {% endfor %}w23 w24",
}
"""Two chat templates over the word tokenizer: a chat renders to 5 tokens with m1's and 7 with
m2's, so the prompt's length says which template the head used."""


@implementer(IAgentEndpointFactory)
class _UnixSocket:
    def __init__(self, path: str) -> None:
        self.path = path

    def endpointForURI(self, uri: Any) -> UNIXClientEndpoint:
        return UNIXClientEndpoint(reactor, self.path)


class MultiHostTests(TestCase):
    timeout = 120

    def setUp(self) -> None:
        reason = netns.unavailable()
        if reason is not None:
            raise SkipTest(reason)
        try:
            import zeroconf  # noqa: F401
        except ImportError as e:
            raise SkipTest(f"zeroconf is not installed: {e}") from None
        self.net = netns.Network(self)
        # Short: a Unix socket's path must fit in 108 bytes.
        self.folder = Path(tempfile.mkdtemp(prefix="sfnt-"))
        self.addCleanup(shutil.rmtree, self.folder, True)
        # The token as an operator makes it: printed on the head's machine, pasted on the nodes'.
        self.head_token = str(self.folder / "head-token")
        made = subprocess.run(
            [sys.executable, "-m", "sfnode", "token", "--file", self.head_token],
            capture_output=True, env=child_env(), timeout=60, check=True,
        )  # fmt: skip
        self.token = self.secret("token", made.stdout.strip())
        self.tokenizer = mock_tokenizer(self.folder / "tokenizer")

    def secret(self, name: str, token: bytes) -> str:
        path = self.folder / name
        path.write_bytes(token + b"\n")
        path.chmod(0o600)
        return str(path)

    def start_head(
        self, host: netns.Host, name: str, *, model: bool = True, **extra: str
    ) -> tuple[Child, str]:
        """A head on ``host``; with ``model``, the mock tokenizer serves ``mock`` (else the
        head has no --model and serves what its nodes bring)."""
        socket = str(self.folder / f"{name}.sock")
        own = ["--model", str(self.tokenizer), "--model-name", "mock"] if model else []
        args = ["sfhead", "--fleet-listen", f"tcp:{FLEET_PORT}", "--http", f"unix:{socket}",
                "--auth-file", self.head_token, *own,
                "--head-name", "test-head",
                "--policy", "round-robin", "--queue-timeout", "20"]  # fmt: skip
        for option, value in extra.items():
            args += [f"--{option}", value]
        return host.spawn_twistd(Child(name), args), socket

    def start_node(
        self, host: netns.Host, identity: str, join: str, token: str, *extra: str
    ) -> Child:
        metrics = self.folder / f"{identity}.sock"
        return host.spawn_twistd(
            Child(identity),
            ["sfnode", "--join", join, "--auth-file", token, "--engine", "mock",
             "--identity", identity, "--metrics", f"unix:{metrics}", *extra],
        )  # fmt: skip

    async def chat(self, socket: str, model: str) -> dict[str, Any]:
        body = {"model": model, "messages": [{"role": "user", "content": "w100 w101"}],
                "max_tokens": 5}  # fmt: skip
        return await self.post(socket, b"/v1/chat/completions", body)

    async def completion(self, socket: str) -> dict[str, Any]:
        body = {"model": "mock", "prompt": [11, 12, 13, 14], "max_tokens": 5}
        return await self.post(socket, b"/v1/completions", body)

    async def post(self, socket: str, path: bytes, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` posted to the head's ``path`` over its Unix socket: the 200 answer."""
        agent = Agent.usingEndpointFactory(reactor, _UnixSocket(socket))
        response = await agent.request(
            b"POST",
            b"http://localhost" + path,
            Headers({b"content-type": [b"application/json"]}),
            FileBodyProducer(BytesIO(json.dumps(body).encode())),
        )
        content = await readBody(response)
        self.assertEqual(response.code, 200, content)
        answer: dict[str, Any] = json.loads(content)
        return answer

    async def decoded(self, identity: str) -> float:
        """The tokens a node has decoded, from its own /metrics."""
        socket = str(self.folder / f"{identity}.sock")
        agent = Agent.usingEndpointFactory(reactor, _UnixSocket(socket))
        response = await agent.request(b"GET", b"http://localhost/metrics")
        text = (await readBody(response)).decode()
        found = re.search(r"^sfnode_decoded_tokens_total\{[^}]*\} (\S+)$", text, re.M)
        assert found is not None, text
        return float(found.group(1))

    async def both_answer(self, socket: str) -> None:
        """Two completions of 5 tokens, placed round robin: each node decodes one."""
        nodes = ("node-a", "node-b")
        before = [await self.decoded(node) for node in nodes]
        for _ in range(2):
            answer = await self.completion(socket)
            self.assertEqual(answer["usage"]["completion_tokens"], 5)
        after = [await self.decoded(node) for node in nodes]
        self.assertEqual([a - b for a, b in zip(after, before, strict=True)], [5, 5])

    def assert_clean(self, *children: Child) -> None:
        for child in children:
            self.assertNotIn(b"Traceback", bytes(child.output), child.name)

    async def test_nodes_join_by_dns_sd_and_address_and_return_after_a_head_restart(self) -> None:
        """A head announces itself on the bridge; node-a (--join auto, no address) finds it
        by DNS-SD and joins, node-b joins by address, node-c (another token) is refused with
        a log line on both sides and keeps trying; both good nodes answer.  The head is
        restarted (SIGTERM, then started again): both nodes are back and answering within
        10 s of its HTTP port opening."""
        head_host, a_host, b_host, c_host = (self.net.add_host(n) for n in ("head", "a", "b", "c"))
        head, socket = self.start_head(head_host, "head")
        await head.wait_for(rb"sfhead announcing 'test-head' on _superfluid-fleet\._tcp")
        wrong = self.secret("wrong", b"2" * 64)
        node_a = self.start_node(a_host, "node-a", "auto", self.token)
        node_b = self.start_node(b_host, "node-b", f"{head_host.address}:{FLEET_PORT}", self.token)
        node_c = self.start_node(c_host, "node-c", "auto", wrong)
        await head.wait_for(rb"node node-a joined")
        await head.wait_for(rb"node node-b joined")
        found = f"found the head 'test-head' at {head_host.address}:{FLEET_PORT}".encode()
        await node_a.wait_for(re.escape(found))
        await self.both_answer(socket)

        await node_c.wait_for(rb"its fleet token differs", 2)
        await node_c.wait_for(rb"the handshake failed: Noise message 1 does not decrypt")
        await head.wait_for(
            re.escape(f"a node that dialed in from {c_host.address}:".encode())
            + rb"\d+ failed the handshake"
        )
        self.assertNotIn(b"node node-c joined", bytes(head.output))

        head.transport.signalProcess("TERM")
        await head.ended
        self.assertIn(b"sfhead stopped announcing", bytes(head.output))
        again, socket = self.start_head(head_host, "head-again")
        await again.wait_for(rb"sfhead serving HTTP on")
        opened = reactor.seconds()
        await again.wait_for(rb"node node-a joined")
        await again.wait_for(rb"node node-b joined")
        await self.both_answer(socket)
        elapsed = reactor.seconds() - opened
        self.assertLess(elapsed, RESTART_TARGET_S, f"nodes back after {elapsed:.1f} s")
        self.assert_clean(head, again, node_a, node_b, node_c)

    async def test_a_node_browses_again_and_finds_its_head_where_it_moved(self) -> None:
        """The head dies (SIGKILL: no goodbye) and starts again on another machine: the node
        that joined by DNS-SD redials, gives the old address up after a few failures, browses
        again and joins the head at its new address."""
        first_host, second_host, node_host = (self.net.add_host(n) for n in ("h1", "h2", "n"))
        head, _ = self.start_head(first_host, "head")
        node = self.start_node(node_host, "node-a", "auto", self.token)
        await head.wait_for(rb"node node-a joined")
        await head.kill()
        moved, socket = self.start_head(second_host, "head-moved")
        await moved.wait_for(rb"node node-a joined")
        await node.wait_for(rb"browsing _superfluid-fleet\._tcp\.local\. again")
        await node.wait_for(re.escape(f"at {second_host.address}:{FLEET_PORT}".encode()))
        answer = await self.completion(socket)
        self.assertEqual(answer["usage"]["completion_tokens"], 5)
        self.assert_clean(moved, node)

    async def test_a_head_without_model_files_serves_two_models_each_on_its_own_node(
        self,
    ) -> None:
        """The head starts with no --model; node-1 (model m1, --join auto) and node-2 (model
        m2, by address) each send their tokenizer and chat template when they join.  A chat
        naming m1 is rendered with m1's template and decoded by node-1 only (twice, under
        round-robin placement), one naming m2 with m2's template by node-2 only; /v1/models
        lists both, one node each."""
        head_host, one_host, two_host = (self.net.add_host(n) for n in ("head", "one", "two"))
        head, socket = self.start_head(head_host, "head", model=False)
        await head.wait_for(rb"sfhead announcing 'test-head' on _superfluid-fleet\._tcp")
        for identity, host, model, join in (
            ("node-1", one_host, "m1", "auto"),
            ("node-2", two_host, "m2", f"{head_host.address}:{FLEET_PORT}"),
        ):
            folder = mock_tokenizer(self.folder / model, TEMPLATES[model])
            self.start_node(host, identity, join, self.token, "--model", str(folder),
                            "--model-name", model)  # fmt: skip
            await head.wait_for(f"node {identity} joined".encode())
        await head.wait_for(rb"installed the model files", 2)
        agent = Agent.usingEndpointFactory(reactor, _UnixSocket(socket))
        response = await agent.request(b"GET", b"http://localhost/v1/models")
        listed = {m["id"]: m["nodes"] for m in json.loads(await readBody(response))["data"]}
        self.assertEqual((listed.get("m1"), listed.get("m2")), (1, 1))
        for model, node, other, prompt in (("m1", "node-1", "node-2", 5),
                                           ("m2", "node-2", "node-1", 7)):  # fmt: skip
            before = await self.decoded(node), await self.decoded(other)
            for _ in range(2):  # twice: round robin over all nodes would reach the other
                answer = await self.chat(socket, model)
                self.assertEqual(
                    (answer["model"], answer["usage"]["prompt_tokens"]), (model, prompt)
                )
            after = await self.decoded(node), await self.decoded(other)
            self.assertEqual((after[0] - before[0], after[1] - before[1]), (10, 0))
        self.assert_clean(head)

    async def test_pipeline_stages_on_two_machines_hand_steps_round_a_ring(self) -> None:
        """Two stage nodes on machines of their own (mock engine, --listen with the fleet
        token) and a head on a third dialling them as a pipeline: a generation alone goes
        round the stage ring (docs/protocol.md section 12.10), each stage dialling the
        other across the bridge at the address the head gave it, over Noise; a second head
        over the same stages with --no-stage-ring (every step through it) gives the same
        tokens."""
        head_host, one_host, two_host = (self.net.add_host(n) for n in ("head", "s0", "s1"))
        stages = []
        for identity, host in (("stage0", one_host), ("stage1", two_host)):
            stage = host.spawn_twistd(
                Child(identity),
                ["sfnode", "--listen", f"tcp:{FLEET_PORT}", "--auth-file", self.token,
                 "--engine", "mock", "--identity", identity],
            )  # fmt: skip
            await stage.wait_for(rb"sfnode listening on")
            stages.append(stage)
        pipeline = f"tcp:{one_host.address}:{FLEET_PORT},tcp:{two_host.address}:{FLEET_PORT}"
        answers = []
        for name, extra in (("ring-head", []), ("plain-head", ["--no-stage-ring"])):
            socket = str(self.folder / f"{name}.sock")
            head = head_host.spawn_twistd(
                Child(name),
                ["sfhead", "--pipeline", pipeline, "--pipeline-layers", "12,24",
                 "--http", f"unix:{socket}", "--auth-file", self.head_token,
                 "--model", str(self.tokenizer), "--model-name", "mock", *extra],
            )  # fmt: skip
            await head.wait_for(rb"sfhead serving HTTP on")
            answer = await self.completion(socket)
            self.assertEqual(answer["usage"]["completion_tokens"], 5)
            answers.append(answer["choices"][0]["text"])
            self.assert_clean(head)
            if name == "ring-head":
                await head.wait_for(rb"pipeline stages joined to stage ring")
                for stage, peer in ((stages[0], two_host), (stages[1], one_host)):
                    opened = f"peer link to tcp:{peer.address}:{FLEET_PORT} open"
                    await stage.wait_for(re.escape(opened.encode()))
            else:
                self.assertNotIn(b"stage ring", bytes(head.output))
            head.transport.signalProcess("TERM")
            await head.ended
        self.assertEqual(answers[0], answers[1])
        self.assert_clean(*stages)
