"""``twistd sfhead`` and ``twistd sfnode`` as real processes: a node killed mid-stream, the
head's options, and ``python -m sfnode fleet`` (``make run``) stopped by Ctrl-C.

Two mock-engine node processes (slow tokens, ``--token-delay-ms``) and a head process on the
bundled tokenizer.  A streamed completion starts on the first node; that process is killed with
SIGKILL after a few chunks; the stream must still complete, correct and without repeats, from the
second node.  No sleeps: every wait is on a line a process logs or on the HTTP stream.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from collections.abc import Generator
from io import BytesIO
from pathlib import Path
from typing import Any

from twisted.internet import defer, reactor
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase
from twisted.web.client import Agent, FileBodyProducer, readBody
from twisted.web.http_headers import Headers

from tests.processes import (
    LOOPBACK,
    Child,
    child_env,
    loopback_head,
    node_endpoint,
    spawn_twistd,
)


class _Stream(Protocol):
    """Collects an HTTP response body; ``content`` fires once ``count`` content chunks came."""

    def __init__(self, count: int) -> None:
        self.body = b""
        self.count = count
        self.content: defer.Deferred[None] = defer.Deferred()
        self.done: defer.Deferred[bytes] = defer.Deferred()

    def dataReceived(self, data: bytes) -> None:
        self.body += data
        if not self.content.called and self.body.count(b'"text": "') >= self.count:
            self.content.callback(None)

    def connectionLost(self, reason: Failure = None) -> None:  # type: ignore[assignment]
        self.done.callback(self.body)


class _Processes(TestCase):
    """A test of twistd processes, each started by :meth:`spawn` and killed at its end."""

    timeout = 120

    def spawn(self, name: str, args: list[str]) -> Child:
        return spawn_twistd(self, Child(name), args)


class KillTests(_Processes):
    @defer.inlineCallbacks
    def test_a_node_killed_mid_stream_is_replaced_by_another(self) -> Generator[Any, Any, None]:
        """SIGKILL the serving node after 3 streamed chunks: the stream completes from the
        other node with exactly the text of an uninterrupted run, no chunk repeated, and the
        head counts one failover."""
        nodes = [
            self.spawn(
                f"node{i}",
                ["sfnode", "--listen", LOOPBACK, "--engine", "mock", "--identity", f"proc{i}",
                 "--token-delay-ms", "25"],
            )
            for i in range(2)
        ]  # fmt: skip
        endpoints = yield defer.gatherResults([node_endpoint(node) for node in nodes])
        head, base = yield loopback_head(
            self.spawn, "--model-name", "mock", "--policy", "least-loaded", nodes=endpoints
        )
        yield head.wait_for(rb"node proc\d joined", 2)
        agent = Agent(reactor)

        def post(body: dict[str, Any]) -> defer.Deferred[Any]:
            return agent.request(
                b"POST",
                (base + "/v1/completions").encode(),
                Headers({b"content-type": [b"application/json"]}),
                FileBodyProducer(BytesIO(json.dumps(body).encode())),
            )

        # Sampled (temperature 1, OpenAI's default) with a seed: the failover must continue the
        # very draws of the reference run.
        request = {"model": "mock", "prompt": list(range(100, 112)), "max_tokens": 100,
                   "seed": 1234}  # fmt: skip
        response = yield post(request)
        reference = json.loads((yield readBody(response)))
        self.assertEqual(reference["usage"]["completion_tokens"], 100)

        # The reference ran on proc0 (least-loaded, registration order), so the stream does too.
        response = yield post({**request, "stream": True})
        self.assertEqual(response.code, 200)
        stream = _Stream(3)
        response.deliverBody(stream)
        yield stream.content
        self.assertNotIn(b"[DONE]", stream.body)  # (nodes batch tokens for up to 200 ms)
        yield nodes[0].kill()
        body = yield stream.done
        events = [
            json.loads(line[len(b"data: ") :])
            for line in body.split(b"\n")
            if line.startswith(b"data: {")
        ]
        self.assertTrue(body.rstrip().endswith(b"data: [DONE]"))
        text = "".join(e["choices"][0]["text"] for e in events)
        self.assertEqual(text, reference["choices"][0]["text"])
        self.assertEqual(events[-1]["choices"][0]["finish_reason"], "length")
        response = yield agent.request(b"GET", (base + "/metrics").encode())
        metrics = (yield readBody(response)).decode()
        self.assertIn("sfhead_failovers_total 1.0", metrics)
        output = bytes(head.output)
        # The redial at once may still reach the dying process (then the connection closes
        # during the handshake); the next finds nobody listening.  Both say so plainly.
        self.assertIn(f"node proc0 ({endpoints[0]}) is down: ".encode(), output)
        self.assertIn(b"could not connect: connection refused", output)
        for chatter in (b"Traceback", b"Starting factory", b"Stopping factory", b"object at 0x"):
            self.assertNotIn(chatter, output)


class StartingNodeTests(_Processes):
    @defer.inlineCallbacks
    def test_a_request_sent_before_the_node_is_up_is_answered(self) -> Generator[Any, Any, None]:
        """A head whose --node is not up yet (a node's first start converts its model) holds a
        completion past its --queue-timeout of 1 s: the node process is started only once the
        request has waited 3 s, and the answer is a 200 with every token."""
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            port = free.getsockname()[1]
        head, base = yield loopback_head(
            self.spawn, "--model-name", "mock", "--queue-timeout", "1", "--reconnect-max", "0.5",
            nodes=[f"tcp:127.0.0.1:{port}"],
        )  # fmt: skip
        body = {"model": "mock", "prompt": list(range(100, 112)), "max_tokens": 20}
        answered = Agent(reactor).request(
            b"POST",
            f"{base}/v1/completions".encode(),
            Headers({b"content-type": [b"application/json"]}),
            FileBodyProducer(BytesIO(json.dumps(body).encode())),
        )
        waited: defer.Deferred[None] = defer.Deferred()
        reactor.callLater(3.0, waited.callback, None)
        yield waited
        self.spawn(
            "node",
            ["sfnode", "--listen", f"tcp:{port}:interface=127.0.0.1", "--engine", "mock",
             "--identity", "late"],
        )  # fmt: skip
        response = yield answered
        answer = json.loads((yield readBody(response)))
        self.assertEqual(response.code, 200, answer)
        self.assertEqual(answer["usage"]["completion_tokens"], 20)
        self.assertIn(b"node late", bytes(head.output))


class OptionsTests(TestCase):
    """``twistd sfhead`` options and the service tree, without starting anything."""

    def parse(self, *args: str) -> Any:
        from sfnode.head.tap import Options

        options = Options()
        options.parseOptions(list(args))
        return options

    def test_defaults_and_repeatable_nodes(self) -> None:
        """Defaults follow the issue (fleet 8455, HTTP 8453 on loopback, load-aware, bundled
        model name); --node repeats; the policy and lease are typed."""
        from sfnode.head.fleet.fleet import Policy

        options = self.parse("--node", "tcp:127.0.0.1:1", "--node", "tcp:127.0.0.1:2")
        self.assertEqual(options["fleet-listen"], "tcp:8455:interface=127.0.0.1")
        self.assertEqual(options["http"], "tcp:8453:interface=127.0.0.1")
        self.assertEqual(options["nodes"], ["tcp:127.0.0.1:1", "tcp:127.0.0.1:2"])
        self.assertIs(options["policy"], Policy.LOAD_AWARE)
        self.assertEqual(options["lease-ms"], 60000)
        self.assertEqual(options["model-name"], "SmolLM2-135M-Instruct")
        self.assertEqual(
            [options[o] for o in ("max-queued", "queue-timeout", "reconnect-max")], [256, 30, 10]
        )
        self.assertEqual(options["node-start-timeout"], 600)
        self.assertEqual(options["keepalive-timeout"], 10.0)

    def test_queue_redial_and_keepalive_options(self) -> None:
        """--max-queued is a count (0: no waiting), the others seconds; --reconnect-max may not
        be below the first redial's 0.1 s; the values reach the fleet."""
        from twisted.internet.testing import MemoryReactorClock
        from twisted.python.usage import UsageError

        from sfnode.head.tap import makeService
        from tests.tinymodel import tiny_tokenizer

        for args in (
            ["--max-queued", "-1"],
            ["--max-queued", "many"],
            ["--queue-timeout", "soon"],
            ["--node-start-timeout", "-1"],
            ["--reconnect-max", "0.01"],
            ["--keepalive-timeout", "-3"],
        ):
            self.assertRaises(UsageError, self.parse, *args)
        folder = self.mktemp()
        tiny_tokenizer().save_pretrained(folder)
        options = self.parse(
            "--model", folder, "--max-queued", "0", "--queue-timeout", "2.5",
            "--reconnect-max", "1", "--keepalive-timeout", "0", "--node-start-timeout", "90",
        )  # fmt: skip
        fleet = makeService(options, MemoryReactorClock()).getServiceNamed("fleet").fleet
        self.assertEqual(
            (
                fleet.queue.max_queued,
                fleet.queue.timeout_s,
                fleet.registry.retry_max_s,
                fleet.link_settings.silence_timeout_s,
                fleet.settings.node_start_s,
            ),
            (0, 2.5, 1.0, 0.0, 90.0),
        )

    def test_prefix_rule_options(self) -> None:
        """--prefix-weight (a number, 6 by default, 0 turns prefixes off) and --prefix-max-skew
        (a count, 6 by default) reach the fleet's prefix rule; negative or non-numeric values
        are usage errors."""
        from twisted.internet.testing import MemoryReactorClock
        from twisted.python.usage import UsageError

        from sfnode.head.fleet.placement import PrefixRule
        from sfnode.head.tap import makeService
        from tests.tinymodel import tiny_tokenizer

        for args in (
            ["--prefix-weight", "-0.5"],
            ["--prefix-weight", "lots"],
            ["--prefix-weight", "inf"],
            ["--prefix-max-skew", "-1"],
            ["--prefix-max-skew", "2.5"],
        ):
            self.assertRaises(UsageError, self.parse, *args)
        self.assertEqual(self.parse()["prefix"], PrefixRule(weight=6.0, max_skew=6))
        folder = self.mktemp()
        tiny_tokenizer().save_pretrained(folder)
        options = self.parse("--model", folder, "--prefix-weight", "2.5", "--prefix-max-skew", "0")
        fleet = makeService(options, MemoryReactorClock()).getServiceNamed("fleet").fleet
        self.assertEqual(fleet.prefix, PrefixRule(weight=2.5, max_skew=0))
        self.assertTrue(fleet.prefix_aware)
        off = self.parse("--model", folder, "--prefix-weight", "0")
        fleet = makeService(off, MemoryReactorClock()).getServiceNamed("fleet").fleet
        self.assertFalse(fleet.prefix_aware)

    def test_bad_values_are_usage_errors(self) -> None:
        """A bad policy, a bad endpoint, a non-loopback node without a token, --pipeline with
        --node, layer boundaries that do not match the stages, spare stages without a
        pipeline or at a bad endpoint, and --no-stage-ring without a pipeline are refused."""
        from twisted.python.usage import UsageError

        for args in (
            ["--policy", "random"],
            ["--node", "nonsense:1"],
            ["--node", "tcp:10.1.2.3:8454"],
            ["--fleet-listen", "tcp:8455"],
            ["--pipeline", "tcp:127.0.0.1:1", "--node", "tcp:127.0.0.1:2"],
            ["--pipeline", "tcp:127.0.0.1:1,tcp:127.0.0.1:2", "--pipeline-layers", "4,8,12"],
            ["--lease-ms", "0"],
            ["--pipeline-spare", "tcp:127.0.0.1:3"],
            ["--pipeline", "tcp:127.0.0.1:1", "--pipeline-spare", "nonsense:1"],
            ["--no-stage-ring"],
        ):
            self.assertRaises(UsageError, self.parse, *args)
        self.assertEqual(
            self.parse("--node", "tcp:10.1.2.3:8454", "--insecure-no-auth")["nodes"],
            ["tcp:10.1.2.3:8454"],
        )

    def test_make_service_builds_a_plain_multiservice(self) -> None:
        """makeService loads only a tokenizer (any HF tokenizer folder) and returns a plain
        MultiService named sfhead with fleet, fleet-listen and http children; a pipeline
        splits its layers as given and keeps its spare stages, and steps in stage rings unless
        --no-stage-ring."""
        from twisted.application.service import MultiService
        from twisted.internet.testing import MemoryReactorClock

        from sfnode.head.tap import makeService
        from tests.tinymodel import tiny_tokenizer

        folder = self.mktemp()
        tiny_tokenizer().save_pretrained(folder)
        options = self.parse("--model", folder, "--http", "tcp:0:interface=127.0.0.1")
        head = makeService(options, MemoryReactorClock())
        self.assertIs(type(head), MultiService)
        self.assertEqual(head.name, "sfhead")
        self.assertEqual([s.name for s in head], ["fleet", "fleet-listen", "http"])
        self.assertEqual(options["model-name"], Path(folder).name)
        piped = self.parse(
            "--model", folder, "--pipeline", "tcp:127.0.0.1:1,tcp:127.0.0.1:2",
            "--pipeline-layers", "24", "--pipeline-spare", "tcp:127.0.0.1:3",
        )  # fmt: skip
        service = makeService(piped, MemoryReactorClock())
        pipeline = service.getServiceNamed("fleet").pipeline
        self.assertEqual(pipeline.ranges, [(0, 12), (12, 24)])
        self.assertEqual(pipeline.spare_endpoints, ["tcp:127.0.0.1:3"])
        self.assertIsNotNone(pipeline.ring)
        piped = self.parse(
            "--model", folder, "--pipeline", "tcp:127.0.0.1:1,tcp:127.0.0.1:2",
            "--pipeline-layers", "24", "--no-stage-ring",
        )  # fmt: skip
        pipeline = makeService(piped, MemoryReactorClock()).getServiceNamed("fleet").pipeline
        self.assertIsNone(pipeline.ring)

    @defer.inlineCallbacks
    def test_the_plugin_is_listed_and_lazy(self) -> Generator[Any, Any, None]:
        """twistd finds the sfhead plugin and parsing its options imports neither torch nor
        zeroconf."""
        from twisted.internet.utils import getProcessOutputAndValue

        script = (
            "import sys\n"
            "from twisted.application.service import IServiceMaker\n"
            "from twisted.plugin import getPlugins\n"
            "makers = {p.tapname: p for p in getPlugins(IServiceMaker)}\n"
            "makers['sfhead'].options().parseOptions([])\n"
            "print('sfhead' in makers, 'torch' in sys.modules, 'zeroconf' in sys.modules)\n"
        )
        out, err, code = yield getProcessOutputAndValue(
            sys.executable, ["-c", script], env=child_env(), path=self.mktemp_dir()
        )
        self.assertEqual((out.split(), code), ([b"True", b"False", b"False"], 0), err)

    @defer.inlineCallbacks
    def test_the_installed_package_brings_its_plugins(self) -> Generator[Any, Any, None]:
        """Run from another folder without PYTHONPATH, the installed sfnode's twistd lists
        sfnode and sfhead: a plain ``pip install -e .`` puts the project root on sys.path
        (so Twisted's plugin scan finds twisted/plugins/), and a wheel ships the plugins."""
        from twisted.internet.utils import getProcessOutputAndValue

        from tests.processes import TWISTD

        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        out, err, code = yield getProcessOutputAndValue(
            sys.executable, ["-c", TWISTD, "--help"], env=env, path=self.mktemp_dir()
        )
        self.assertEqual(code, 0, err)
        self.assertRegex(out.decode(), r"\n\s+sfnode\s+A Link F node agent")
        self.assertRegex(out.decode(), r"\n\s+sfhead\s+A Link F fleet head")

    def mktemp_dir(self) -> str:
        folder = Path(self.mktemp())
        folder.mkdir(parents=True)
        return str(folder)


class _Exiting(Child):
    """A child that remembers its exit status."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.status: int | None = None

    def processEnded(self, reason: Failure) -> None:
        self.status = getattr(reason.value, "exitCode", None)
        super().processEnded(reason)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class MakeRunTests(TestCase):
    timeout = 180

    @defer.inlineCallbacks
    def test_ctrl_c_stops_the_fleet_cleanly(self) -> Generator[Any, Any, None]:
        """``python -m sfnode fleet`` (mock engine) prints the console's address, whose state
        shows the node serving, and serves a completion; a SIGINT to its
        process group, as a terminal sends on Ctrl-C, stops the head and the node once each and
        exits 0 with no traceback."""
        node_port, http_port, fleet_port = _free_port(), _free_port(), _free_port()
        folder = Path(self.mktemp())
        folder.mkdir(parents=True)
        # A session of its own, like a shell's foreground job: the group a terminal signals.
        script = (
            "import os, runpy, sys; os.setsid(); sys.argv[0:1] = ['sfnode', 'fleet']; "
            "runpy.run_module('sfnode', run_name='__main__')"
        )
        child = _Exiting("fleet")
        child.transport = reactor.spawnProcess(
            child,
            sys.executable,
            [sys.executable, "-c", script, "--engine", "mock", "--node-port", str(node_port),
             "--http-port", str(http_port), "--fleet-port", str(fleet_port)],
            env=child_env(),
            path=str(folder),
        )  # fmt: skip

        def cleanup() -> defer.Deferred[None]:
            if not child.ended.called:
                child.transport.signalProcess("INT")
            return child.ended

        self.addCleanup(cleanup)
        yield child.wait_for(rb"The fleet is up on")
        printed = yield child.wait_for(rb"Watch it live at (\S+/console) ")
        response = yield Agent(reactor).request(b"GET", printed[0].group(1) + b"/state")
        state = json.loads((yield readBody(response)))
        self.assertEqual([n["state"] for n in state["nodes"]], ["serving"])
        body = {"model": "mock", "prompt": [100, 101, 102], "max_tokens": 4}
        response = yield Agent(reactor).request(
            b"POST",
            f"http://127.0.0.1:{http_port}/v1/completions".encode(),
            Headers({b"content-type": [b"application/json"]}),
            FileBodyProducer(BytesIO(json.dumps(body).encode())),
        )
        self.assertEqual(response.code, 200)
        yield readBody(response)
        os.killpg(child.transport.pid, signal.SIGINT)
        yield child.ended
        output = bytes(child.output)
        self.assertEqual(child.status, 0, output.decode(errors="replace"))
        self.assertNotIn(b"Traceback", output)
        self.assertNotIn(b"ReactorNotRunning", output)
        self.assertEqual(output.count(b"Received SIGTERM"), 2)
        self.assertNotIn(b"Received SIGINT", output)


class QuietStartTests(TestCase):
    timeout = 180

    @defer.inlineCallbacks
    def test_no_progress_bars_in_a_log(self) -> Generator[Any, Any, None]:
        """A node whose output is not a terminal (here a pipe) loads its model without tqdm
        progress bars ("Loading weights: 100%|...") in that output."""
        from tests.tinymodel import save_tiny_model

        model = save_tiny_model(Path(self.mktemp()).resolve() / "tiny")
        node = spawn_twistd(
            self,
            Child("node"),
            ["sfnode", "--listen", LOOPBACK, "--engine", "transformers", "--model", str(model)],
        )
        yield node.wait_for(rb"sfnode listening on")
        output = bytes(node.output)
        self.assertIn(b"Read tiny as stored", output)
        self.assertNotIn(b"it/s]", output)
        self.assertNotIn(b"Loading weights", output)
