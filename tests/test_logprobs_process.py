"""Logprobs end to end (issue 11, docs/protocol.md section 12.1): the official ``openai``
package against a ``twistd sfhead`` process whose node is a ``twistd sfnode`` process.

The same cases run against a node on the mock engine (:class:`MockEngineTests`) and on the
tiny transformers model (:class:`TransformersEngineTests`): the engine is the one class
attribute they differ by.  A node whose HELLO_ACK_F lacks FEATURE_LOGPROBS fails the mock's
cases and skips the transformers' ones (an engine without logprobs yet).  The tests of a class
share its two processes (started by the first, stopped after the last).  No sleeps: every
wait is on a line a process logs or on an HTTP answer.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from collections.abc import Generator
from pathlib import Path
from typing import Any, ClassVar

from twisted.internet import defer, reactor, threads
from twisted.trial.unittest import SkipTest, TestCase

from sfnode.head.link import HeadIds, connect_node
from sfnode.linkf.wire import FEATURE_LOGPROBS
from tests.clients import openai_client
from tests.processes import LOOPBACK, NODE_LISTENING, SharedProcess, stop_after_the_class

MESSAGES = [{"role": "user", "content": "hello world"}]
READY_S = 120.0
"""How long a process may take to log that it is ready."""


class _NodeAndHead:
    """A ``twistd sfnode`` process on ``engine`` and a ``twistd sfhead`` process over it,
    shared by the tests of that engine's class: each test's requests are its own, and none
    changes what the processes hold for the next."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.node = SharedProcess(f"{engine} node")
        self.head = SharedProcess(f"{engine} head")
        self.features: int | None = None
        """What the node offers in HELLO_ACK_F, once it was asked."""
        self.base = ""
        self.model = ""

    def args(self, folder: Path) -> tuple[list[str], list[str], str]:
        """(node arguments, head arguments, model name) for :attr:`engine`."""
        if self.engine == "mock":
            # The head's tokenizer is the bundled model's: its vocabulary covers the mock's.
            return ["--engine", "mock"], ["--model-name", "mock"], "mock"
        from tests.tinymodel import save_tiny_model

        tiny = str(save_tiny_model(folder / "tiny"))
        return (
            ["--engine", "transformers", "--model", tiny],
            ["--model", tiny, "--model-name", "tiny"],
            "tiny",
        )

    @defer.inlineCallbacks
    def start(self) -> Generator[defer.Deferred[Any], Any, None]:
        """The node, its HELLO_ACK_F's features, then (if it offers logprobs) the head."""
        folder = Path(tempfile.mkdtemp(prefix=f"sfnode-logprobs-{self.engine}-"))
        atexit.register(shutil.rmtree, folder, True)
        node_args, head_args, self.model = self.args(folder)
        self.node.start_twistd(
            ["sfnode", "--listen", LOOPBACK, "--identity", "n", *node_args], folder
        )
        found = yield threads.deferToThread(self.node.wait_for, NODE_LISTENING, READY_S)
        endpoint = f"tcp:127.0.0.1:{int(found.group(1))}"
        link = yield connect_node(reactor, endpoint, ids=HeadIds())
        features = link.features or 0
        yield link.close()
        if features & FEATURE_LOGPROBS:
            self.head.start_twistd(
                ["sfhead", "--http", LOOPBACK, "--fleet-listen", LOOPBACK, "--node", endpoint,
                 *head_args],
                folder,
            )  # fmt: skip
            found = yield threads.deferToThread(
                self.head.wait_for, rb"sfhead serving HTTP on 127\.0\.0\.1:(\d+)\n", READY_S
            )
            self.base = f"http://127.0.0.1:{int(found.group(1))}/v1"
        self.features = features

    def stop(self) -> None:
        self.head.stop()
        self.node.stop()
        self.features = None


_PROCESSES: dict[str, _NodeAndHead] = {}


class _LogprobsProcessCases(TestCase):
    """The cases; a subclass names the engine (``mock`` or ``transformers``)."""

    engine: ClassVar[str] = ""
    logprob_tolerance: ClassVar[float] = 0.0
    """How far one logprob may differ between two runs of the same greedy request."""
    timeout = 300

    @defer.inlineCallbacks
    def serve(self) -> Generator[defer.Deferred[Any], Any, tuple[Any, str]]:
        """The class's node process and head process over it (started by its first test,
        stopped after its last); (an openai client, the model name)."""
        processes = _PROCESSES.setdefault(self.engine, _NodeAndHead(self.engine))
        stop_after_the_class(self, processes.stop)
        if processes.features is None:
            yield processes.start()
        if not processes.features & FEATURE_LOGPROBS:
            if self.engine != "mock":
                raise SkipTest(f"the {self.engine} engine does not return logprobs yet")
            self.fail("a mock node does not offer FEATURE_LOGPROBS")
        return openai_client(self, processes.base), processes.model

    @defer.inlineCallbacks
    def test_greedy_chat_logprobs_plain_and_streamed(self) -> Generator[Any, Any, None]:
        """logprobs=True, top_logprobs=3 under greedy: one entry per completion token, each
        with three top_logprobs, best first, the first being the chosen token with the same
        logprob; streamed with include_usage, the chunks' entries put together are the same
        (tokens and bytes exactly, logprobs within :attr:`logprob_tolerance`) and the last
        chunk carries the usage."""
        client, model = yield self.serve()
        ask = {
            "model": model, "messages": MESSAGES, "max_tokens": 12, "temperature": 0,
            "logprobs": True, "top_logprobs": 3,
        }  # fmt: skip

        def plain() -> Any:
            return client.chat.completions.create(**ask)

        def streamed() -> list[Any]:
            return list(
                client.chat.completions.create(
                    **ask, stream=True, stream_options={"include_usage": True}
                )
            )

        completion = yield threads.deferToThread(plain)
        (choice,) = completion.choices
        entries = choice.logprobs.content
        self.assertEqual(len(entries), completion.usage.completion_tokens)
        self.assertGreater(len(entries), 0)
        for entry in entries:
            self.assertEqual(len(entry.top_logprobs), 3)
            best = entry.top_logprobs[0]
            self.assertEqual((best.token, best.logprob, best.bytes),
                             (entry.token, entry.logprob, entry.bytes))  # fmt: skip
            values = [t.logprob for t in entry.top_logprobs]
            self.assertEqual(values, sorted(values, reverse=True))
            self.assertLessEqual(entry.logprob, 0.0)
        chunks = yield threads.deferToThread(streamed)
        together = [
            entry
            for chunk in chunks
            for c in chunk.choices
            if c.logprobs is not None
            for entry in c.logprobs.content
        ]
        self.assert_same_entries(together, entries)
        self.assertEqual(chunks[-1].choices, [])
        self.assertEqual(chunks[-1].usage.completion_tokens, completion.usage.completion_tokens)
        text = "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices)
        self.assertEqual(text, choice.message.content)

    def assert_same_entries(self, got: list[Any], expected: list[Any]) -> None:
        """The same logprobs entries: every field equal, the logprob values (the entry's and
        its top ones) within :attr:`logprob_tolerance`."""

        def values(entries: list[Any]) -> list[float]:
            return [v for e in entries for v in (e.logprob, *(t.logprob for t in e.top_logprobs))]

        def without_values(entries: list[Any]) -> list[Any]:
            return [
                {
                    **e.model_dump(exclude={"logprob"}),
                    "top_logprobs": [t.model_dump(exclude={"logprob"}) for t in e.top_logprobs],
                }
                for e in entries
            ]

        self.assertEqual(without_values(got), without_values(expected))
        for a, b in zip(values(got), values(expected), strict=True):
            self.assertLessEqual(
                abs(a - b), self.logprob_tolerance, (values(got), values(expected))
            )

    @defer.inlineCallbacks
    def test_completion_logprobs_with_two_choices(self) -> Generator[Any, Any, None]:
        """/v1/completions with logprobs=2 and n=2 under greedy: each choice lists one token,
        logprob, top mapping (the chosen token its best entry) and text offset per completion
        token."""
        client, model = yield self.serve()

        def complete() -> Any:
            return client.completions.create(
                model=model, prompt="hello world", max_tokens=8, temperature=0, logprobs=2, n=2
            )

        completion = yield threads.deferToThread(complete)
        self.assertEqual([c.index for c in completion.choices], [0, 1])
        for choice in completion.choices:
            logprobs = choice.logprobs
            count = len(logprobs.tokens)
            self.assertEqual(count * 2, completion.usage.completion_tokens)
            self.assertEqual(
                [len(logprobs.token_logprobs), len(logprobs.top_logprobs),
                 len(logprobs.text_offset)],
                [count] * 3,
            )  # fmt: skip
            for token, value, top in zip(
                logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
            ):
                self.assertLessEqual(len(top), 3)
                self.assertEqual(top[token], value)
                self.assertEqual(max(top.values()), value)


class MockEngineTests(_LogprobsProcessCases):
    engine = "mock"


class TransformersEngineTests(_LogprobsProcessCases):
    engine = "transformers"
    logprob_tolerance = 1e-4
    # The second request finds the first one's prompt in the prefix cache and computes from
    # where the cached blocks end: the same values up to float rounding, not bit for bit
    # (docs/engine.md section 4).  Seen: differences up to 1.7e-6 on the tiny model.


del _LogprobsProcessCases
