"""What a node says it runs on (docs/protocol.md section 12.9, D27): the TELEMETRY map's codec,
the CPU as ``/proc/cpuinfo`` names it, and each engine's path."""

from __future__ import annotations

import msgpack
from twisted.internet import reactor
from twisted.trial.unittest import SynchronousTestCase

from sfnode.linkf.platform import (
    PLATFORM_TEXT_MAX,
    NodePlatform,
    decode_platform,
    encode_platform,
)
from sfnode.node.host import cpu_description

X86 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx avx2 fma f16c bmi2
"""
ARM = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes
"""


class CodecTests(SynchronousTestCase):
    def test_round_trip_and_the_example(self) -> None:
        """A platform survives the codec, and encodes as the map of section 12.9."""
        platform = NodePlatform("AMD EPYC (avx2)", "mock")
        spans = encode_platform(platform)
        self.assertEqual(decode_platform(spans), platform)
        self.assertEqual(msgpack.unpackb(spans), {"cpu": "AMD EPYC (avx2)", "engine": "mock"})

    def test_the_doc_example(self) -> None:
        """docs/protocol.md section 12.9's example, both ways."""
        spans = bytes.fromhex("82a3637075a67838365f3634a6656e67696e65a46d6f636b")
        self.assertEqual(encode_platform(NodePlatform("x86_64", "mock")), spans)
        self.assertEqual(decode_platform(spans), NodePlatform("x86_64", "mock"))

    def test_long_texts_are_cut_on_send(self) -> None:
        """A text longer than the bound is cut to it by the sender, so a receiver takes it."""
        spans = encode_platform(NodePlatform("c" * 500, "e" * 500))
        decoded = decode_platform(spans)
        assert decoded is not None
        self.assertEqual(len(decoded.cpu), PLATFORM_TEXT_MAX)

    def test_anything_else_is_not_a_platform(self) -> None:
        """Other telemetry (upstream's spans), malformed msgpack, a map with other keys or
        types, and texts over the bound are each None, never an exception."""
        for spans in (
            b"",
            b"\xc1",
            b"\x93\x01",
            msgpack.packb([1, 2, 3]),
            msgpack.packb({"cpu": "x"}),
            msgpack.packb({"cpu": "x", "engine": "y", "more": 1}),
            msgpack.packb({"cpu": 1, "engine": "y"}),
            msgpack.packb({"cpu": "x" * (PLATFORM_TEXT_MAX + 1), "engine": "y"}),
            msgpack.packb({1: "x", 2: "y"}),
        ):
            self.assertIsNone(decode_platform(spans), spans)


class CpuTests(SynchronousTestCase):
    def test_x86_names_its_model_and_extensions(self) -> None:
        """An x86 CPU is its model name and the vector extensions the kernels choose by."""
        path = self.mktemp()
        with open(path, "w") as f:
            f.write(X86)
        from pathlib import Path

        self.assertEqual(cpu_description(Path(path)), "AMD EPYC 7B13 (avx2 fma f16c)")

    def test_arm_and_an_unreadable_file(self) -> None:
        """An ARM CPU without a model name is named by the machine, with its extensions; an
        unreadable /proc/cpuinfo still gives the machine's architecture."""
        import platform
        from pathlib import Path

        path = self.mktemp()
        with open(path, "w") as f:
            f.write(ARM)
        machine = platform.machine() or "unknown"
        self.assertEqual(cpu_description(Path(path)), f"{machine} (asimd)")
        self.assertEqual(cpu_description(Path(self.mktemp())), machine)


class EnginePathTests(SynchronousTestCase):
    def test_each_engine_says_how_it_computes(self) -> None:
        """The tiny Llama's engine names its step and weights (the native step where the
        kernels load, torch operators when it is turned off); the mock and a refusing node
        say what they are."""
        from sfnode.engines.config import EngineConfig
        from sfnode.engines.kernels import native
        from sfnode.engines.mock import MockEngine
        from sfnode.engines.transformers_engine import TransformersEngine
        from sfnode.node.refused import RefusedEngine
        from tests.tinymodel import tiny_llama

        model = tiny_llama()
        fused = TransformersEngine(model, reactor, EngineConfig())
        operators = TransformersEngine(model, reactor, EngineConfig(fused_step=False))
        from tests.test_engine import native_library_dir

        native_here = not isinstance(native.load(native_library_dir()), str)
        self.assertEqual(
            fused.path,
            ("native step" if native_here else "torch operators") + ", float32 weights",
        )
        self.assertEqual(operators.path, "torch operators, float32 weights")
        self.assertEqual(MockEngine(reactor).path, "mock")
        self.assertIn("refused", RefusedEngine("no").path)
