"""Tests of sfnode.node.tap and the ``twistd sfnode`` plugin: options, embedding, and a real
process.

They pin the command line (defaults, every refusal as a usage error that names the option,
docs/protocol.md section 5.4 token trimming, D9 one direction of exactly one of --head/--listen, D10
no plaintext off loopback), that the plugin is found without importing torch, that ``makeService``
is a plain ``MultiService`` another program can embed and that it answers a head's HELLO in both
directions, that --head redials 0.1 s, 0.2 s, ... 2 s apart (D9), and that ``twistd sfnode`` serves,
shuts down cleanly on SIGTERM and turns a bad option into a usage message, not a traceback.

The mock engine serves every test but one, which builds the transformers engine on the tiny
random model of ``tests.tinymodel`` to check that the options reach it; no test downloads or
loads a real model.
"""

from __future__ import annotations

import os
import re
import socket
import sys
from pathlib import Path
from typing import Any

from twisted.application.service import IServiceMaker, MultiService
from twisted.internet import defer, reactor
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP4ServerEndpoint, connectProtocol
from twisted.internet.error import ConnectionRefusedError, ProcessDone
from twisted.internet.protocol import Factory, ProcessProtocol, Protocol, connectionDone
from twisted.internet.testing import MemoryReactorClock
from twisted.internet.utils import getProcessOutputAndValue
from twisted.logger import capturedLogs, formatEvent
from twisted.plugin import getPlugins
from twisted.python import usage
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.client import Agent, readBody

from sfnode.head.fleet.backend import HeadRequest
from sfnode.head.link import HeadIds, connect_node
from sfnode.head.tap import HeadStartupError
from sfnode.linkf.wire import (
    FINISH_LENGTH,
    FrameDecoder,
    Hello,
    HelloAckF,
    LinkRole,
    Message,
    decode_frame,
    message_frame,
)
from sfnode.node import tap
from sfnode.node.config import NodeConfig
from sfnode.runtime.service import (
    DEFAULT_MODEL_NAME,
    ListeningService,
    StartupError,
    default_model_name,
    server_from_string,
)
from tests.nodefixture import expected_tokens
from tests.processes import LOOPBACK, REPO_ROOT, TWISTD, child_env


def parse(*argv: str) -> tap.Options:
    options = tap.Options()
    options.parseOptions(list(argv))
    return options


def run_python(*args: str) -> defer.Deferred[tuple[bytes, bytes, int]]:
    """Run this Python with ``args``; fires with (stdout, stderr, exit code)."""
    result: defer.Deferred[tuple[bytes, bytes, int]] = getProcessOutputAndValue(
        sys.executable, args, env=child_env(), path=str(REPO_ROOT), reactor=reactor
    )
    return result


class HeadProbe(Protocol):
    """Speaks first like a head (HELLO); ``answer`` fires with the first message it gets back."""

    def __init__(self) -> None:
        self.decoder = FrameDecoder()
        self.answer: defer.Deferred[Message] = defer.Deferred()
        self.closed: defer.Deferred[None] = defer.Deferred()

    def connectionMade(self) -> None:
        hello = Hello((2, 2), LinkRole.HEAD_DAEMON, b"")
        self.transport.write(message_frame(hello, 1))  # type: ignore[union-attr]

    def dataReceived(self, data: bytes) -> None:
        for frame in self.decoder.feed(data):
            if not self.answer.called:
                self.answer.callback(decode_frame(frame))

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if not self.answer.called:
            self.answer.errback(reason)
        self.closed.callback(None)


async def hello_over_tcp(port: int) -> Message:
    """Connect to 127.0.0.1:``port``, say HELLO, return the answer once the link is closed."""
    probe = HeadProbe()
    await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", port), probe)
    answer = await probe.answer
    probe.transport.loseConnection()  # type: ignore[union-attr]
    await probe.closed
    return answer


class OptionsTests(SynchronousTestCase):
    """``Options`` checks everything before any service exists."""

    def assert_usage_error(self, argv: list[str], *fragments: str) -> str:
        """Parsing ``argv`` raises UsageError whose message holds every fragment."""
        error = self.assertRaises(usage.UsageError, parse, *argv)
        message = str(error)
        for fragment in fragments:
            self.assertIn(fragment, message)
        return message

    def test_defaults(self) -> None:
        """Defaults follow docs/protocol.md section 4.4: 8 lanes, 10 s handshake, 120 s idle
        timeout, no token; a node that listens says so (stage rings, section 12.10)."""
        options = parse("--listen", LOOPBACK, "--engine", "mock")
        self.assertEqual(options["listen"], LOOPBACK)
        self.assertIsNone(options["head"])
        self.assertEqual(options["max-lanes"], 8)
        self.assertEqual(options["max-context"], 0)
        self.assertEqual(options["handshake-timeout-ms"], 10_000)
        self.assertEqual(options["idle-timeout-ms"], 120_000)
        self.assertEqual(options["token-delay-ms"], 0)
        self.assertEqual(options["auth-token"], b"")
        self.assertEqual(options["model-name"], "mock")
        self.assertEqual(options["identity"], socket.gethostname())
        self.assertEqual(
            tap.node_config(options), NodeConfig(identity=options["identity"], listens=True)
        )

    def test_transformers_defaults(self) -> None:
        """The default engine is transformers, on the bundled SmolLM2, auto dtype and device."""
        options = parse("--listen", LOOPBACK)
        self.assertEqual(options["engine"], "transformers")
        self.assertIsNone(options["model"])
        self.assertEqual(options["model-name"], "SmolLM2-135M-Instruct")
        self.assertEqual((options["dtype"], options["device"]), ("auto", "auto"))
        self.assertEqual((options["threads"], options["kv-blocks"]), (0, 0))
        self.assertEqual((options["step-tokens"], options["step-ms"]), (512, 250))

    def test_model_name_from_model_path(self) -> None:
        """Without --model-name a model folder gives its name and a .gguf file its stem."""
        folder = Path(self.mktemp()) / "TinyLlama-chat"
        folder.mkdir(parents=True)
        gguf = folder.parent / "Qwen2-0.5B.Q8_0.gguf"
        gguf.write_bytes(b"")
        self.assertEqual(
            parse("--listen", LOOPBACK, "--model", str(folder))["model-name"], "TinyLlama-chat"
        )
        self.assertEqual(
            parse("--listen", LOOPBACK, "--model", str(gguf))["model-name"], "Qwen2-0.5B.Q8_0"
        )
        named = parse("--listen", LOOPBACK, "--model", str(gguf), "--model-name", "qwen")
        self.assertEqual(named["model-name"], "qwen")

    def test_explicit_values_are_typed(self) -> None:
        """Given values come back as ints and strings, and reach the NodeConfig unchanged."""
        options = parse(
            *"--head tcp:127.0.0.1:9000 --engine mock --identity n1 --max-lanes 3 "
            "--max-context 512 --handshake-timeout-ms 0 --idle-timeout-ms 5 "
            "--token-delay-ms 7 --model-name m".split()
        )
        expected = NodeConfig(
            model_name="m", identity="n1", max_lanes=3, handshake_timeout_ms=0, idle_timeout_ms=5
        )
        self.assertEqual(tap.node_config(options), expected)
        self.assertEqual((options["max-context"], options["token-delay-ms"]), (512, 7))

    def test_status_interval(self) -> None:
        """--status-interval-ms sets how often the node sends NODE_STATUS (the NodeConfig's
        interval; 2 s by default) and refuses anything but a whole number of at least 1 ms."""
        options = parse("--listen", LOOPBACK, "--engine", "mock")
        self.assertEqual(tap.node_config(options).status_interval_ms, 2_000)
        options = parse("--listen", LOOPBACK, "--engine", "mock", "--status-interval-ms", "750")
        self.assertEqual(options["status-interval-ms"], 750)
        self.assertEqual(tap.node_config(options).status_interval_ms, 750)
        for value in ("0", "-1", "1.5", "soon"):
            self.assert_usage_error(
                ["--listen", LOOPBACK, "--engine", "mock", "--status-interval-ms", value],
                "--status-interval-ms must be",
                repr(value),
            )

    def test_neither_head_nor_listen(self) -> None:
        """A node with no direction is refused: it would never meet a head (D9)."""
        self.assert_usage_error(["--engine", "mock"], "--head", "--listen")

    def test_both_head_and_listen(self) -> None:
        """A node given both directions is refused rather than silently picking one (D9)."""
        self.assert_usage_error(
            ["--head", "tcp:127.0.0.1:1", "--listen", LOOPBACK], "exactly one", "--head", "--listen"
        )

    def test_bad_integers(self) -> None:
        """Every integer option refuses non-numbers and negatives, naming itself and the value."""
        cases = [
            ("max-lanes", "abc", "mock"),
            ("max-lanes", "0", "mock"),
            ("max-lanes", "-2", "mock"),
            ("max-context", "-1", "mock"),
            ("max-context", "1.5", "mock"),
            ("handshake-timeout-ms", "soon", "mock"),
            ("idle-timeout-ms", "-5", "mock"),
            ("token-delay-ms", "-1", "mock"),
            ("threads", "many", "transformers"),
            ("kv-blocks", "-3", "transformers"),
            ("step-ms", "-1", "transformers"),
            ("step-ms", "fast", "transformers"),
        ]
        for name, value, engine in cases:
            self.assert_usage_error(
                ["--listen", LOOPBACK, "--engine", engine, f"--{name}", value],
                f"--{name} must be",
                repr(value),
            )

    def test_bad_choices(self) -> None:
        """--engine, --dtype and --device accept only the documented values."""
        self.assert_usage_error(["--listen", LOOPBACK, "--engine", "llama"], "--engine", "mock")
        self.assert_usage_error(["--listen", LOOPBACK, "--dtype", "int4"], "--dtype", "bfloat16")
        self.assert_usage_error(["--listen", LOOPBACK, "--device", "tpu"], "--device", "cuda:N")
        self.assertEqual(parse("--listen", LOOPBACK, "--device", "cuda:1")["device"], "cuda:1")

    def test_engine_specific_options(self) -> None:
        """An option of the other engine is refused instead of being silently ignored."""
        self.assert_usage_error(
            ["--listen", LOOPBACK, "--token-delay-ms", "5"], "--token-delay-ms", "transformers"
        )
        self.assert_usage_error(
            ["--listen", LOOPBACK, "--engine", "mock", "--dtype", "float32", "--threads", "2"],
            "--dtype",
            "--threads",
            "mock",
        )
        self.assert_usage_error(
            ["--listen", LOOPBACK, "--engine", "mock", "--stock-kernels"], "--stock-kernels", "mock"
        )

    def test_missing_model(self) -> None:
        """A --model path that does not exist is named before anything is loaded."""
        missing = os.path.abspath(self.mktemp())
        self.assert_usage_error(["--listen", LOOPBACK, "--model", missing], missing)

    def test_bad_endpoints(self) -> None:
        """Endpoint strings are syntax-checked: bad port, unknown type, missing port."""
        self.assert_usage_error(["--listen", "tcp:http"], "--listen", "'tcp:http'")
        self.assert_usage_error(["--listen", "carrier-pigeon:1"], "--listen", "carrier-pigeon")
        self.assert_usage_error(["--head", "tcp:127.0.0.1"], "--head", "'tcp:127.0.0.1'")

    def test_auth_file_trimmed(self) -> None:
        """The token is the file's bytes without surrounding ASCII whitespace (docs/protocol.md
        section 5.4)."""
        path = Path(self.mktemp())
        path.write_bytes(b" \t\r\n0af3c2 token\r\n\x0c ")
        options = parse("--listen", LOOPBACK, "--auth-file", str(path), "--engine", "mock")
        self.assertEqual(options["auth-token"], b"0af3c2 token")
        self.assertEqual(tap.node_config(options).auth_token, b"0af3c2 token")

    def test_empty_auth_file_means_no_token(self) -> None:
        """A file of whitespace only is no token, so loopback rules apply (docs/protocol.md section
        5.4)."""
        path = Path(self.mktemp())
        path.write_bytes(b"\n  \n")
        options = parse("--listen", LOOPBACK, "--auth-file", str(path), "--engine", "mock")
        self.assertEqual(options["auth-token"], b"")
        self.assert_usage_error(
            ["--listen", "tcp:0", "--auth-file", str(path)], "without a fleet token"
        )

    def test_missing_auth_file_named(self) -> None:
        """An unreadable --auth-file is a usage error that names the path."""
        missing = os.path.abspath(self.mktemp())
        self.assert_usage_error(["--listen", LOOPBACK, "--auth-file", missing], missing)

    def test_plaintext_only_on_loopback(self) -> None:
        """Without a token a non-loopback listen or head is refused unless overridden (D10)."""
        self.assert_usage_error(["--listen", "tcp:8454"], "without a fleet token", "--auth-file")
        self.assert_usage_error(["--listen", "tcp:8454:interface=0.0.0.0"], "without a fleet token")
        self.assert_usage_error(["--head", "tcp:10.1.2.3:8454"], "without a fleet token")
        parse("--listen", "tcp:8454", "--insecure-no-auth")
        parse("--head", "tcp:10.1.2.3:8454", "--insecure-no-auth")
        parse("--listen", "tcp6:8454:interface=\\:\\:1")
        parse("--listen", "tcp6:8454:50:\\:\\:1")
        self.assert_usage_error(["--listen", "tcp6:8454"], "without a fleet token")
        self.assert_usage_error(["--listen", "tcp6:8454:127"], "without a fleet token")
        parse("--listen", "unix:/tmp/sfnode.sock")
        parse("--head", "tcp:localhost:8454")
        token = Path(self.mktemp())
        token.write_bytes(b"secret\n")
        parse("--listen", "tcp:8454", "--auth-file", str(token))

    def test_every_option_documented(self) -> None:
        """Every option has help text, and --help shows it."""
        text = str(tap.Options())
        for name, _short, *rest in tap.Options.optParameters + tap.Options.optFlags:
            doc = rest[-1] if len(rest) == 1 else rest[1]
            self.assertTrue(doc, name)
            self.assertIn(f"--{name}", text)


class PluginTests(TestCase):
    """The plugin is found by twistd, and stays lazy."""

    def test_plugin_registered(self) -> None:
        """Twisted's plugin scanner finds ``sfnode`` and it points at sfnode.node.tap."""
        makers = {maker.tapname: maker for maker in getPlugins(IServiceMaker)}
        self.assertIn("sfnode", makers)
        maker: Any = makers["sfnode"]
        self.assertEqual(maker.module, "sfnode.node.tap")
        self.assertIs(maker.options, tap.Options)

    async def test_twistd_help_lists_sfnode_without_torch(self) -> None:
        """``twistd --help`` lists sfnode and ``twistd sfnode --help`` works (one usage line),
        importing neither torch nor zeroconf."""
        probe = (
            "import atexit, sys\n"
            "atexit.register(lambda: print('TORCH', 'torch' in sys.modules))\n"
            "atexit.register(lambda: print('ZEROCONF', 'zeroconf' in sys.modules))\n"
            "sys.argv = ['twistd'] + sys.argv[1:]\n"
            "from twisted.scripts.twistd import run\n"
            "run()\n"
        )
        out, err, code = await run_python("-c", probe, "--help")
        self.assertEqual(code, 0, err)
        self.assertRegex(out.decode(), r"\n\s+sfnode\s+A Link F node agent")
        self.assertIn("TORCH False", out.decode())
        out, err, code = await run_python("-c", probe, "sfnode", "--help")
        self.assertEqual(code, 0, err)
        first = out.decode().splitlines()[0]
        self.assertEqual(
            first,
            "Usage: twistd [options] sfnode (--join HOST[:PORT] | --join auto | --head ENDPOINT "
            "| --listen ENDPOINT) [options]",
        )
        self.assertIn("--listen=", out.decode())
        self.assertIn("--join=", out.decode())
        self.assertIn("--auth-file=", out.decode())
        self.assertIn("TORCH False", out.decode())
        self.assertIn("ZEROCONF False", out.decode())


    async def test_a_mock_node_runs_without_torch(self) -> None:
        """A node on ``--engine mock`` (its engine: the engine loop, the scheduler and the mock
        runner; its agent) runs a sampled generation with logprobs without importing torch:
        heads and protocol tests run the mock."""
        probe = (
            "import sys\n"
            "from twisted.internet.task import Clock\n"
            "from sfnode.generation import GenerationRequest\n"
            "from sfnode.linkf.wire import GenParams\n"
            "from sfnode.node import tap\n"
            "from sfnode.node.agent import NodeAgent\n"
            "options = tap.Options()\n"
            "options.parseOptions(['--listen', 'tcp:0:interface=127.0.0.1', '--engine', 'mock'])\n"
            "clock = Clock()\n"
            "engine = tap.build_engine(clock, options)\n"
            "NodeAgent(clock, engine, tap.node_config(options)).start()\n"
            "got = []\n"
            "params = GenParams(temperature=0.8, seed=5, logprobs=2)\n"
            "engine.submit(GenerationRequest((1, 2, 3), params, 4), got.extend)\n"
            "for _ in range(10):\n"
            "    clock.advance(0)\n"
            "print('TOKENS', len(got))\n"
            "print('TORCH', 'torch' in sys.modules)\n"
        )
        out, err, code = await run_python("-c", probe)
        self.assertEqual(code, 0, err)
        self.assertIn("TOKENS 4", out.decode())
        self.assertIn("TORCH False", out.decode())


class EmbeddingTests(TestCase):
    """``makeService`` is a plain service tree that another program can run."""

    async def test_embedded_listen_answers_hello(self) -> None:
        """Embedded under a parent, the node logs its bound port, answers HELLO, and stops."""
        options = parse("--listen", LOOPBACK, "--engine", "mock", "--identity", "embedded-1")
        node = tap.makeService(options, reactor)
        self.assertIsInstance(node, MultiService)
        parent = MultiService()
        node.setServiceParent(parent)
        with capturedLogs() as events:
            parent.startService()
        listen: Any = node.getServiceNamed("listen")
        port = listen.port.getHost().port
        lines = [formatEvent(event) for event in events]
        self.assertEqual(
            [line for line in lines if line.startswith("sfnode listening")],
            [f"sfnode listening on 127.0.0.1:{port}"],
        )

        answer = await hello_over_tcp(port)
        self.assertIsInstance(answer, HelloAckF)
        assert isinstance(answer, HelloAckF)
        self.assertEqual(answer.chosen_version, 2)
        self.assertEqual(answer.node_identity, "embedded-1")
        self.assertEqual(answer.loadable_models, ("mock",))
        self.assertEqual(answer.capacity.max_lanes, 8)

        await parent.stopService()
        self.assertFalse(node.running)
        self.assertIsNone(listen.port)
        probe = connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", port), HeadProbe())
        await self.assertFailure(probe, ConnectionRefusedError)

    async def test_metrics_endpoint_serves_engine_figures(self) -> None:
        """--metrics serves the node's engine figures in Prometheus format; after a generation
        the decoded-token counter shows its tokens, and the bound address is logged."""
        options = parse(
            "--listen", LOOPBACK, "--engine", "mock", "--identity", "metered",
            "--metrics", LOOPBACK,
        )  # fmt: skip
        node = tap.makeService(options, reactor)
        with capturedLogs() as events:
            node.startService()
        self.addCleanup(node.stopService)
        metrics_port = node.getServiceNamed("metrics").port.getHost().port  # type: ignore[attr-defined]
        node_port = node.getServiceNamed("listen").port.getHost().port  # type: ignore[attr-defined]
        lines = [formatEvent(event) for event in events]
        self.assertIn(f"sfnode metrics on 127.0.0.1:{metrics_port}", lines)

        link = await connect_node(reactor, f"tcp:127.0.0.1:{node_port}", ids=HeadIds())
        link.assign(1)
        link.append(1, [1, 2, 3])
        await link.generate(1, HeadRequest((), 12)).result
        await link.close()

        agent = Agent(reactor)
        response = await agent.request(b"GET", f"http://127.0.0.1:{metrics_port}/metrics".encode())
        body = (await readBody(response)).decode()
        self.assertEqual(response.code, 200)
        self.assertIn('sfnode_decoded_tokens_total{model="mock",node="metered"} 12.0', body)
        self.assertIn('sfnode_max_lanes{model="mock",node="metered"} 8.0', body)
        self.assertIn("sfnode_kv_blocks_total", body)

    async def test_transformers_engine_from_options(self) -> None:
        """--engine transformers builds the engine from --model and its options, and serves."""
        from tests.tinymodel import save_tiny_model

        folder = save_tiny_model(Path(self.mktemp()).resolve() / "tiny-llama")
        options = parse(
            *f"--listen {LOOPBACK} --model {folder} --device cpu --threads 1 "
            "--max-context 128 --kv-blocks 40 --max-lanes 2".split()
        )
        node = tap.makeService(options, reactor)
        node.startService()
        try:
            answer = await hello_over_tcp(node.getServiceNamed("listen").port.getHost().port)
        finally:
            await node.stopService()
        self.assertIsInstance(answer, HelloAckF)
        assert isinstance(answer, HelloAckF)
        self.assertEqual(answer.loadable_models, ("tiny-llama",))
        self.assertEqual(answer.capacity.max_context_tokens, 128)
        self.assertEqual(answer.capacity.kv_blocks_total, 40)
        self.assertEqual(answer.capacity.max_lanes, 2)

    def test_stock_kernels_and_weights_options(self) -> None:
        """--stock-kernels builds an engine on the model's own forward; by default a Llama runs
        through sfnode's own step, and --weights chooses how its weights are held; --step-ms
        reaches the scheduler (250 by default); --weights int4 with --stock-kernels, or an
        unknown mode, is a usage error."""
        from sfnode.engines.transformers_engine import TransformersEngine
        from tests.tinymodel import save_tiny_model

        folder = save_tiny_model(Path(self.mktemp()).resolve() / "tiny-llama")
        base = f"--listen {LOOPBACK} --model {folder} --device cpu".split()
        stock = tap.build_engine(reactor, parse(*base, "--stock-kernels"))
        default = tap.build_engine(reactor, parse(*base))
        int4 = tap.build_engine(reactor, parse(*base, "--weights", "int4"))
        assert isinstance(stock, TransformersEngine) and isinstance(default, TransformersEngine)
        assert isinstance(int4, TransformersEngine)
        self.assertEqual((stock.weights.onednn_layers, stock.lean_step), (0, False))
        self.assertEqual((default.lean_step, default.weights.mode), (True, "float32"))
        self.assertEqual((int4.lean_step, int4.weights.mode), (True, "int4"))
        self.assertEqual(default.scheduler.step_ms, 250)
        timed = tap.build_engine(reactor, parse(*base, "--step-ms", "80"))
        assert isinstance(timed, TransformersEngine)
        self.assertEqual(timed.scheduler.step_ms, 80)
        for bad in (("--weights", "int3"), ("--weights", "int4", "--stock-kernels")):
            with self.assertRaises(usage.UsageError) as caught:
                parse(*base, *bad)
            self.assertIn("--weights", str(caught.exception))

    def test_kernels_and_eager_step_options(self) -> None:
        """--kernels torch serves int4 with torch's kernels in bfloat16, --kernels native with
        sfnode's in float32 and the fused step, which --eager-step turns off; an unknown family,
        or either option with the mock engine, is a usage error (docs/engine.md 5.1, 5.2)."""
        import torch

        from sfnode.engines.kernels import native
        from sfnode.engines.transformers_engine import TransformersEngine
        from sfnode.engines.weights.loading import default_cache_dir
        from tests.tinymodel import save_tiny_model

        folder = save_tiny_model(Path(self.mktemp()).resolve() / "tiny-llama")
        base = f"--listen {LOOPBACK} --model {folder} --device cpu --weights int4".split()
        torch_kernels = tap.build_engine(reactor, parse(*base, "--kernels", "torch"))
        assert isinstance(torch_kernels, TransformersEngine)
        self.assertEqual(
            (torch_kernels.weights.kernels, torch_kernels.fused_step), ("int4 x 13", False)
        )
        self.assertEqual(torch_kernels.weights.activations, torch.bfloat16)
        if not isinstance(native.load(default_cache_dir().parent / "kernels"), str):
            own = tap.build_engine(reactor, parse(*base, "--kernels", "native"))
            eager = tap.build_engine(reactor, parse(*base, "--kernels", "native", "--eager-step"))
            assert isinstance(own, TransformersEngine) and isinstance(eager, TransformersEngine)
            self.assertEqual((own.weights.activations, own.fused_step), (torch.float32, True))
            self.assertEqual((eager.weights.activations, eager.fused_step), (torch.float32, False))
        with self.assertRaises(usage.UsageError) as caught:
            parse(*base, "--kernels", "fast")
        self.assertIn("--kernels", str(caught.exception))
        for flag in (("--kernels", "torch"), ("--eager-step",)):
            with self.assertRaises(usage.UsageError) as caught:
                parse("--listen", LOOPBACK, "--engine", "mock", *flag)
            self.assertIn(flag[0], str(caught.exception))

    def test_speculative_options(self) -> None:
        """--speculative ngram with --draft-tokens builds an engine that drafts that many tokens
        (docs/engine.md section 3.1); by default it does not draft; an unknown mode, a draft
        length out of range, or either option with the mock engine is a usage error."""
        from sfnode.engines.transformers_engine import TransformersEngine
        from tests.tinymodel import save_tiny_model

        folder = save_tiny_model(Path(self.mktemp()).resolve() / "tiny-llama")
        base = f"--listen {LOOPBACK} --model {folder} --device cpu".split()
        default = tap.build_engine(reactor, parse(*base))
        drafting = tap.build_engine(
            reactor, parse(*base, "--speculative", "ngram", "--draft-tokens", "7")
        )
        assert isinstance(default, TransformersEngine) and isinstance(drafting, TransformersEngine)
        self.assertIsNone(default.speculation)
        assert drafting.speculation is not None
        self.assertEqual(drafting.speculation.draft_tokens, 7)
        for bad, name in (
            (("--speculative", "medusa"), "--speculative"),
            (("--draft-tokens", "0"), "--draft-tokens"),
            (("--draft-tokens", "65"), "--draft-tokens"),
        ):
            with self.assertRaises(usage.UsageError) as caught:
                parse(*base, *bad)
            self.assertIn(name, str(caught.exception))
        for flag in (("--speculative", "ngram"), ("--draft-tokens", "2")):
            with self.assertRaises(usage.UsageError) as caught:
                parse("--listen", LOOPBACK, "--engine", "mock", *flag)
            self.assertIn(flag[0], str(caught.exception))

    async def test_head_mode_dials_and_answers(self) -> None:
        """With --head the node dials the head, which then says HELLO first and is answered."""
        probes: list[HeadProbe] = []
        dialled: defer.Deferred[HeadProbe] = defer.Deferred()

        def head_protocol() -> HeadProbe:
            probe = HeadProbe()
            probes.append(probe)
            if not dialled.called:
                dialled.callback(probe)
            return probe

        head_port = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(
            Factory.forProtocol(head_protocol)
        )
        self.addCleanup(head_port.stopListening)
        head = f"tcp:127.0.0.1:{head_port.getHost().port}"
        options = parse("--head", head, "--engine", "mock", "--identity", "d1")
        node = tap.makeService(options, reactor)
        node.startService()
        probe = await dialled
        answer = await probe.answer
        self.assertIsInstance(answer, HelloAckF)
        assert isinstance(answer, HelloAckF)
        self.assertEqual(answer.node_identity, "d1")
        await node.stopService()
        await probe.closed
        self.assertEqual(len(probes), 1)


class SharedServiceTests(SynchronousTestCase):
    """sfnode.runtime.service: the pieces both twistd plugins build on."""

    def test_a_listener_logs_where_it_listens_and_fires_bound(self) -> None:
        """ListeningService logs "{program} {what} {address}" once bound and fires ``bound``
        with the port; stopping it stops listening."""
        clock = MemoryReactorClock()
        listener = ListeningService(
            server_from_string(clock, "tcp:8454:interface=127.0.0.1"),
            Factory(),
            "tcp:8454:interface=127.0.0.1",
            what="listening on",
            program="sfnode",
        )
        with capturedLogs() as events:
            listener.startService()
        assert listener.bound is not None
        port = self.successResultOf(listener.bound)
        self.assertIs(port, listener.port)
        host = port.getHost()
        self.assertEqual(
            [formatEvent(e) for e in events], [f"sfnode listening on {host.host}:{host.port}"]
        )
        self.successResultOf(listener.stopService())
        self.assertIsNone(listener.port)

    def test_a_listen_that_fails_at_once_is_a_startup_error(self) -> None:
        """A port that cannot be bound raises the program's StartupError naming the endpoint."""

        class Taken:
            def listen(self, factory: Any) -> defer.Deferred[Any]:
                return defer.fail(OSError("address already in use"))

        for program, error in (("sfnode", tap.NodeStartupError), ("sfhead", HeadStartupError)):
            listener = ListeningService(
                Taken(), Factory(), "tcp:8454", what="listening on", program=program, error=error
            )
            with self.assertRaises(error) as raised:
                listener.startService()
            self.assertIsInstance(raised.exception, StartupError)
            self.assertEqual(
                str(raised.exception),
                f"{program}: cannot listen on tcp:8454: address already in use",
            )
            self.assertFalse(listener.running)

    def test_both_programs_name_a_model_alike(self) -> None:
        """The node offers and the head serves the same name for one model path; the mock
        engine is offered as "mock"."""
        folder = Path(self.mktemp()) / "My-Model"
        folder.mkdir(parents=True)
        gguf = Path(self.mktemp())
        gguf.write_bytes(b"")
        for model, name in ((None, DEFAULT_MODEL_NAME), (str(folder), "My-Model")):
            self.assertEqual(default_model_name(model), name)
        self.assertEqual(default_model_name(str(gguf.with_suffix(".gguf"))), gguf.stem)
        node = parse("--listen", LOOPBACK, "--engine", "transformers", "--model", str(folder))
        self.assertEqual(node["model-name"], "My-Model")
        self.assertEqual(parse("--listen", LOOPBACK, "--engine", "mock")["model-name"], "mock")


class RedialTests(SynchronousTestCase):
    """--head reconnects with the D9 backoff, on a fake clock."""

    def test_policy_delays(self) -> None:
        """The policy gives 0.1, 0.2, 0.4, 0.8, 1.6, 2 s for failed attempts 1 to 6; jitter
        shortens a delay by up to a fifth, never lengthens it."""
        delays = [tap.head_retry_policy(lambda: 0.0)(attempt) for attempt in range(1, 7)]
        self.assertEqual([round(d, 3) for d in delays], [0.1, 0.2, 0.4, 0.8, 1.6, 2.0])
        self.assertAlmostEqual(tap.head_retry_policy(lambda: 0.5)(10_000), 1.8)

    def test_backoff_doubles_to_two_seconds_and_names_the_endpoint(self) -> None:
        """After each failed dial the next comes 0.1, 0.2, 0.4, 0.8, 1.6, 2 s later (a fifth
        less at most); the redial is logged once with the endpoint string and the reason,
        never an endpoint object."""
        clock = MemoryReactorClock()
        options = parse("--head", "tcp:127.0.0.1:8455", "--engine", "mock")
        node = tap.makeService(options, clock)
        with capturedLogs() as events:
            node.startService()
            self.assertEqual(len(clock.tcpClients), 1)
            self.assertEqual(clock.tcpClients[0][:2], ("127.0.0.1", 8455))
            for delay in (0.1, 0.2, 0.4, 0.8, 1.6, 2.0):
                attempts = len(clock.tcpClients)
                factory = clock.tcpClients[-1][2]
                factory.clientConnectionFailed(
                    clock.connectors[-1], Failure(ConnectionRefusedError())
                )
                clock.advance(delay * 0.8 - 0.001)
                self.assertEqual(len(clock.tcpClients), attempts, f"redialled before {delay} s")
                clock.advance(delay * 0.2 + 0.002)
                self.assertEqual(len(clock.tcpClients), attempts + 1, f"no redial by {delay} s")
        lines = [formatEvent(e) for e in events]
        redials = [line for line in lines if "redialling" in line]
        self.assertEqual(len(redials), 1, lines)
        self.assertRegex(
            redials[0],
            r"^the head at tcp:127\.0\.0\.1:8455: could not connect: connection refused; "
            r"redialling in 0\.\d s \(attempt 1\)$",
        )
        self.assertFalse([line for line in lines if "object at 0x" in line], lines)
        stopped = node.stopService()
        clock.advance(0)
        self.successResultOf(stopped)


class TwistdProcess(ProcessProtocol):
    """A ``twistd sfnode`` child: ``listening`` fires with its port, ``ended`` with its end."""

    def __init__(self) -> None:
        self.output = bytearray()
        self.listening: defer.Deferred[int] = defer.Deferred()
        self.ended: defer.Deferred[BaseException | None] = defer.Deferred()

    def childDataReceived(self, childFD: int, data: bytes) -> None:  # noqa: N803
        self.output += data
        if not self.listening.called:
            found = re.search(rb"sfnode listening on 127\.0\.0\.1:(\d+)\n", self.output)
            if found:
                self.listening.callback(int(found.group(1)))

    def processEnded(self, reason: Failure) -> None:
        if not self.listening.called:
            self.listening.errback(
                RuntimeError(f"twistd ended before listening:\n{self.output.decode()}")
            )
        self.ended.callback(reason.value)

    async def stopped(self, test: TestCase) -> str:
        """Its output, once it has ended; fails ``test`` unless it exited 0 after logging
        "sfnode stopped", with no traceback."""
        ended = await self.ended
        output = self.output.decode()
        test.assertIsInstance(ended, ProcessDone, output)
        test.assertIn("sfnode stopped", output)
        test.assertNotIn("Traceback", output)
        return output

    def kill(self) -> defer.Deferred[BaseException | None] | None:
        """Make sure the child does not outlive its test (a cleanup: waits for its end)."""
        if self.ended.called:
            return None
        self.transport.signalProcess("KILL")
        return self.ended


class ProcessTests(TestCase):
    """``twistd sfnode`` as an operator runs it."""

    async def test_serves_and_stops_on_sigterm(self) -> None:
        """A real twistd process binds tcp:0, answers HELLO, and on SIGTERM stops the node and
        exits 0 (not by the signal twistd would re-raise), with no traceback."""
        output = await self.serve_then_terminate(
            [sys.executable, "-c", TWISTD, "--pidfile=", "-n", "sfnode"]
        )
        self.assertIn("Server Shut Down.", output)

    async def test_twist_runner_serves_too(self) -> None:
        """``python -m twisted sfnode`` (the ``twist`` runner) serves and stops the same way."""
        await self.serve_then_terminate(
            [sys.executable, "-m", "twisted", "--log-format=text", "sfnode"]
        )

    async def serve_then_terminate(self, command: list[str]) -> str:
        """Run ``command`` with a mock node on tcp:0, check HELLO and a clean SIGTERM stop.

        Returns the child's output.
        """
        process = TwistdProcess()
        args = [*command, "--listen", LOOPBACK, "--engine", "mock", "--identity", "proc-1"]
        transport = reactor.spawnProcess(
            process, sys.executable, args, env=child_env(), path=self.mktemp_dir()
        )
        self.addCleanup(process.kill)

        port = await process.listening
        answer = await hello_over_tcp(port)
        self.assertIsInstance(answer, HelloAckF)
        assert isinstance(answer, HelloAckF)
        self.assertEqual(answer.node_identity, "proc-1")

        transport.signalProcess("TERM")
        output = await process.stopped(self)
        self.assertIn("Main loop terminated.", output)
        self.assertNotIn("Unhandled", output)
        return output

    async def test_generates_through_a_real_process(self) -> None:
        """Item 66: a real ``twistd -n sfnode --listen tcp:0:... --engine mock`` process names
        its identity in HELLO_ACK_F and its 12 tokens equal a local run."""
        process = TwistdProcess()
        args = [
            sys.executable, "-c", TWISTD, "--pidfile=", "-n", "sfnode",
            "--listen", LOOPBACK, "--engine", "mock", "--identity", "proc-node",
        ]  # fmt: skip
        reactor.spawnProcess(process, sys.executable, args, env=child_env(), path=self.mktemp_dir())
        self.addCleanup(process.kill)
        port = await process.listening
        link = await connect_node(reactor, f"tcp:127.0.0.1:{port}", ids=HeadIds())
        self.assertEqual(link.node_identity, "proc-node")
        prompt = list(range(100, 112))
        link.assign(1)
        link.append(1, prompt)
        outcome = await link.generate(1, HeadRequest((), 12)).result
        self.assertEqual(outcome.tokens, expected_tokens(prompt, 12))
        self.assertEqual(outcome.finish, FINISH_LENGTH)
        await link.close()

    async def test_bad_option_is_a_usage_error(self) -> None:
        """A bad option makes twistd print the usage and the reason, exit non-zero, no traceback."""
        out, err, code = await run_python(
            "-c", TWISTD, *f"-n sfnode --listen {LOOPBACK} --engine mock --max-lanes lots".split()
        )
        text = (out + err).decode()
        self.assertNotEqual(code, 0, text)
        self.assertIn("--max-lanes must be an integer of at least 1, not 'lots'", text)
        self.assertIn("--listen=", text)
        self.assertNotIn("Traceback", text)

    async def test_port_in_use_exits_with_reason(self) -> None:
        """A port that is already taken ends twistd non-zero with the reason, no traceback."""
        taken = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(Factory())
        self.addCleanup(taken.stopListening)
        port = taken.getHost().port
        out, err, code = await run_python(
            "-c", TWISTD, "--pidfile=", "-n", "sfnode", "--engine", "mock",
            "--listen", f"tcp:{port}:interface=127.0.0.1",
        )  # fmt: skip
        text = (out + err).decode()
        self.assertNotEqual(code, 0, text)
        self.assertIn(f"cannot listen on tcp:{port}:interface=127.0.0.1", text)
        self.assertNotIn("Traceback", text)

    async def test_unloadable_model_exits_with_reason(self) -> None:
        """A model that cannot be loaded ends twistd non-zero, naming it, with no traceback."""
        folder = self.mktemp_dir()
        out, err, code = await run_python(
            "-c", TWISTD, "--pidfile=", "-n", "sfnode", "--listen", LOOPBACK, "--model", folder
        )
        text = (out + err).decode()
        self.assertNotEqual(code, 0, text)
        self.assertIn(f"sfnode: model folder has no config.json: {folder}", text)
        self.assertNotIn("Traceback", text)

    def mktemp_dir(self) -> str:
        """A fresh working folder for the child (twistd writes nothing there with --pidfile=)."""
        path = Path(self.mktemp()).resolve()
        path.mkdir(parents=True)
        return str(path)
