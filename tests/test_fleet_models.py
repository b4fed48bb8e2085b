"""Several models in one fleet, and the model files a node sends its head (docs/protocol.md
sections 8.5 and 12.5): the registry's rules alone, the bundle and its checked transfer, and a
head built with no tokenizer of its own serving two models from the files its mock nodes send,
on the memory reactor (tests/memoryhead.py; the transfer is the point: chunks, hashes, a link
per node).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from sfnode.engines.mock import MockEngine, mock_next_token
from sfnode.head.api.gauges import gateway_gauges
from sfnode.head.api.http import OpenAIApi
from sfnode.head.fleet.backend import BackendStatus
from sfnode.head.fleet.fleet import NoNodeAvailable
from sfnode.head.fleet.model_admission import ModelAdmission
from sfnode.head.link.files import FilesFetch
from sfnode.head.link.machine import LinkError
from sfnode.head.models.chat import ChatMessage
from sfnode.head.models.registry import ModelRegistry
from sfnode.head.models.text import HeadTokenizer, Renderer
from sfnode.linkf.model_files import (
    CHUNK_BYTES,
    MAX_BUNDLE_BYTES,
    Bundle,
    ModelFilesError,
    Reassembly,
    make_bundle,
    read_bundle,
    transfer_messages,
    unpack_bundle,
)
from sfnode.linkf.wire import (
    FEATURE_MODEL_FILES,
    BlobFetchMsg,
    CapacitySummary,
    HelloAckF,
    LinkFLimits,
    ModelFilesOffer,
    XferBeginMsg,
    XferChunkMsg,
    XferEndMsg,
    decode_message,
)
from tests.memoryhead import InlineWorkers, MemoryHead, MemoryHeadTestCase
from tests.nodefixture import MemoryNode
from tests.test_http_hostile import request_bytes, response_of
from tests.tinymodel import TINY_VOCAB, tiny_tokenizer

TEMPLATE_A = (
    "{% for m in messages %}[A:{{ m.role }}] {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}[A:assistant] {% endif %}"
)
TEMPLATE_B = (
    "{% for m in messages %}<<B {{ m.role }}>>{{ m.content }}<</B>>{% endfor %}"
    "{% if add_generation_prompt %}<<B assistant>>{% endif %}"
)
VOCAB_B = 300
"""Node B's mock engine draws from fewer ids, so its tokens tell which node answered."""
MESSAGES = [{"role": "user", "content": "hello world"}]
"""Where a head takes nodes that dial in (nothing is bound: the reactor is a memory reactor)."""

_FOLDERS: dict[str, Path] = {}


def tokenizer_folder(root: str, template: str) -> Path:
    """A folder with the tiny tokenizer's files and ``template`` as chat_template.jinja."""
    key = template
    if key not in _FOLDERS:
        folder = Path(root) / f"tokenizer-{len(_FOLDERS)}"
        tiny_tokenizer().save_pretrained(str(folder))
        (folder / "chat_template.jinja").write_text(template)
        _FOLDERS[key] = folder
    return _FOLDERS[key]


def bundle_of(root: str, template: str) -> Bundle:
    bundle = read_bundle(tokenizer_folder(root, template))
    assert bundle is not None
    return bundle


def expected_tokens(context: Sequence[int], count: int, vocab: int) -> list[int]:
    context = list(context)
    for _ in range(count):
        context.append(mock_next_token(context, vocab))
    return context[len(context) - count :]


class BundleTests(SynchronousTestCase):
    """The bundle of model files, its content hash and the checked reassembly."""

    def test_a_bundle_round_trips_and_its_hash_names_its_content(self) -> None:
        """A folder's files come back by name; other files change the hash, the same files
        give the same hash; a folder without tokenizer.json has no bundle."""
        root = self.mktemp()
        a, b = bundle_of(root, TEMPLATE_A), bundle_of(root, TEMPLATE_B)
        files = unpack_bundle(a.data)
        self.assertEqual(files["chat_template.jinja"], TEMPLATE_A.encode())
        self.assertIn("tokenizer.json", files)
        self.assertEqual(make_bundle(files), a)
        self.assertNotEqual(a.content_hash, b.content_hash)
        empty = Path(root) / "empty"
        empty.mkdir(parents=True)
        self.assertIsNone(read_bundle(empty))

    def test_a_bundle_holds_only_the_files_a_head_reads(self) -> None:
        """Names outside the list, duplicates, a missing tokenizer.json and bytes that are not
        a bundle are refused with a ModelFilesError."""
        with self.assertRaises(ModelFilesError):
            make_bundle({"../../etc/passwd": b"x", "tokenizer.json": b"{}"})
        for data in (
            encode_message_free([["tokenizer.json", b"{}"], ["tokenizer.json", b"{}"]]),
            encode_message_free([["config.json", b"{}"]]),
            encode_message_free([["evil.py", b""], ["tokenizer.json", b"{}"]]),
            b"\xc1",
            encode_message_free({"tokenizer.json": b"{}"}),
        ):
            with self.assertRaises(ModelFilesError):
                unpack_bundle(data)

    def test_a_large_bundle_travels_in_chunks_and_is_checked_whole(self) -> None:
        """A bundle of 3.5 MiB is sent as XFER_BEGIN, four chunks of at most 1 MiB and
        XFER_END, each frame within its type's limit, and reassembles to the same bytes."""
        big = make_bundle({"tokenizer.json": b"x" * (3 * CHUNK_BYTES + CHUNK_BYTES // 2)})
        messages = list(transfer_messages(big, 7))
        self.assertEqual(len(messages), 6)
        reassembly = Reassembly(big.content_hash)
        for message in messages:
            decoded = decode_message(message.MSG_TYPE, message.payload())
            if isinstance(decoded, XferBeginMsg):
                reassembly.begin(decoded)
            elif isinstance(decoded, XferChunkMsg):
                self.assertLessEqual(len(decoded.data), CHUNK_BYTES)
                reassembly.chunk(decoded)
            else:
                assert isinstance(decoded, XferEndMsg)
                self.assertEqual(reassembly.end(decoded), big.data)

    def test_a_transfer_that_is_not_the_one_asked_for_fails(self) -> None:
        """Another hash, a gap, too many bytes, a short transfer, a corrupted byte, a size
        above the bound and a chunk before XFER_BEGIN are each a ModelFilesError."""
        bundle = make_bundle({"tokenizer.json": b"y" * 100})
        begin, chunk, end = transfer_messages(bundle, 1)
        assert isinstance(begin, XferBeginMsg) and isinstance(chunk, XferChunkMsg)
        assert isinstance(end, XferEndMsg)

        def run(*steps: Any) -> None:
            reassembly = Reassembly(bundle.content_hash)
            with self.assertRaises(ModelFilesError):
                for step in steps:
                    getattr(reassembly, step[0])(step[1])

        other = make_bundle({"tokenizer.json": b"z"})
        run(("begin", XferBeginMsg(1, 5, other.checksum, 1, other.content_hash)))
        run(("chunk", chunk))
        run(("begin", begin), ("chunk", XferChunkMsg(1, 3, chunk.data)))
        run(("begin", begin), ("chunk", chunk), ("chunk", XferChunkMsg(1, len(chunk.data), b"x")))
        run(("begin", begin), ("chunk", XferChunkMsg(1, 0, chunk.data[:-1])), ("end", end))
        corrupt = chunk.data[:-1] + bytes([chunk.data[-1] ^ 1])
        run(("begin", begin), ("chunk", XferChunkMsg(1, 0, corrupt)), ("end", end))
        huge = XferBeginMsg(1, MAX_BUNDLE_BYTES + 1, bundle.checksum, 1, bundle.content_hash)
        run(("begin", huge))

    def test_hello_ack_carries_the_offer_only_when_there_is_one(self) -> None:
        """HELLO_ACK_F without files is the six-element message every head reads; with them
        a seventh element names the hash and length (section 12.5)."""
        plain = HelloAckF(2, "n", CapacitySummary(), ("m",), 0, LinkFLimits())
        offered = HelloAckF(
            2, "n", CapacitySummary(), ("m",), FEATURE_MODEL_FILES, LinkFLimits(),
            ModelFilesOffer(b"\x01" * 32, 1234),
        )  # fmt: skip
        self.assertEqual(len(plain.to_wire()), 6)
        self.assertEqual(len(offered.to_wire()), 7)
        for message in (plain, offered):
            self.assertEqual(decode_message(message.MSG_TYPE, message.payload()), message)

    def test_hello_ack_carries_a_refusal_as_an_eighth_element(self) -> None:
        """A node that refused its model (D25) names none and writes its reason as an eighth
        element, after a nil seventh when it offers no files; a head reads the reason back,
        and a six- or seven-element message as no refusal."""
        refused = HelloAckF(
            2, "n", CapacitySummary(), (), 0, LinkFLimits(), refused="GGUF architecture 'x'"
        )
        wire = refused.to_wire()
        self.assertEqual((len(wire), wire[6], wire[7]), (8, None, "GGUF architecture 'x'"))
        self.assertEqual(decode_message(refused.MSG_TYPE, refused.payload()), refused)
        plain = HelloAckF(2, "n", CapacitySummary(), ("m",), 0, LinkFLimits())
        self.assertIsNone(decode_message(plain.MSG_TYPE, plain.payload()).refused)


def encode_message_free(obj: Any) -> bytes:
    import msgpack

    data: bytes = msgpack.packb(obj, use_bin_type=True)
    return data


class RegistryTests(SynchronousTestCase):
    """The registry's rule for a node that names a model (sfnode.head.models.registry)."""

    def setUp(self) -> None:
        root = self.mktemp()
        self.a = bundle_of(root, TEMPLATE_A)
        self.b = bundle_of(root, TEMPLATE_B)

    def test_files_bind_a_name_and_other_files_for_it_are_refused(self) -> None:
        """An unknown bundle is fetched; once installed it serves the name; a node naming that
        model with other files is refused, with both hashes in the reason."""
        registry = ModelRegistry()
        verdict = registry.judge("m", self.a.content_hash)
        self.assertEqual((verdict.admit, verdict.fetch), (False, self.a.content_hash))
        registry.install(self.a.content_hash, self.a.data)
        self.assertTrue(registry.judge("m", self.a.content_hash).admit)
        served = registry.get("m")
        assert served is not None
        self.assertEqual(served.content_hash, self.a.content_hash)
        refused = registry.judge("m", self.b.content_hash)
        self.assertFalse(refused.admit)
        self.assertIsNone(refused.fetch)
        self.assertIn(self.a.short_hash, refused.reason)
        self.assertIn(self.b.short_hash, refused.reason)

    def test_one_copy_per_distinct_bundle(self) -> None:
        """Two names with the same files share one tokenizer: the second is served at once,
        without a fetch."""
        registry = ModelRegistry()
        registry.install(self.a.content_hash, self.a.data)
        registry.install(self.a.content_hash, self.a.data)
        self.assertTrue(registry.judge("one", self.a.content_hash).admit)
        self.assertTrue(registry.judge("two", self.a.content_hash).admit)
        one, two = registry.get("one"), registry.get("two")
        assert one is not None and two is not None
        self.assertIs(one.renderer.codec, two.renderer.codec)
        self.assertEqual(registry.bundles, 1)
        self.assertEqual(registry.names(), ("one", "two"))

    def test_a_node_without_files_needs_a_model_the_head_serves(self) -> None:
        """A node that sends no files is refused for a model the head does not serve, and
        admitted for one it does."""
        registry = ModelRegistry()
        refused = registry.judge("m", None)
        self.assertFalse(refused.admit)
        self.assertIn("--model", refused.reason)
        registry.install(self.a.content_hash, self.a.data)
        registry.judge("m", self.a.content_hash)
        self.assertTrue(registry.judge("m", None).admit)

    def test_an_override_admits_any_files_and_a_provisional_one_gives_way(self) -> None:
        """``--model`` serves its name whatever files nodes bring (nothing fetched); the
        bundled tokenizer served provisionally is replaced by the first files for its name."""
        registry = ModelRegistry()
        registry.serve("fixed", tiny_tokenizer(), origin="--model x", override=True)
        self.assertTrue(registry.judge("fixed", self.a.content_hash).admit)
        fixed = registry.get("fixed")
        assert fixed is not None
        self.assertIsNone(fixed.content_hash)
        registry.serve("soft", tiny_tokenizer(), origin="bundled", provisional=True)
        self.assertTrue(registry.judge("soft", None).admit)
        self.assertEqual(registry.judge("soft", self.b.content_hash).fetch, self.b.content_hash)
        registry.install(self.b.content_hash, self.b.data)
        self.assertTrue(registry.judge("soft", self.b.content_hash).admit)
        soft = registry.get("soft")
        assert soft is not None
        self.assertEqual((soft.content_hash, soft.provisional), (self.b.content_hash, False))

    def test_files_that_make_no_tokenizer_are_refused(self) -> None:
        """A bundle whose tokenizer.json does not parse is a ModelFilesError at install."""
        broken = make_bundle({"tokenizer.json": b"not json"})
        with self.assertRaises(ModelFilesError):
            ModelRegistry().install(broken.content_hash, broken.data)

    def test_the_head_tokenizer_reads_files_as_it_reads_a_folder(self) -> None:
        """HeadTokenizer.from_files renders and encodes exactly as the folder's HeadTokenizer."""
        root = self.mktemp()
        folder = tokenizer_folder(root, TEMPLATE_B)
        files = unpack_bundle(bundle_of(root, TEMPLATE_B).data)
        messages = [ChatMessage("user", "hello world")]
        self.assertEqual(
            Renderer(HeadTokenizer.from_files(files)).chat(messages),
            Renderer(HeadTokenizer(folder)).chat(messages),
        )


class TwoModelTests(MemoryHeadTestCase):
    """A head with no tokenizer of its own serving two models from its nodes' files."""

    def start_model_node(
        self, identity: str, model_name: str, bundle: Bundle | None, vocab: int = TINY_VOCAB
    ) -> MemoryNode:
        engine = MockEngine(self.reactor, vocab_size=vocab)
        return self.start_mock_node(
            identity, engine=engine, model_name=model_name, model_files=bundle
        )

    def model_head(self, nodes: Sequence[MemoryNode], **fleet_options: Any) -> MemoryHead:
        """A head with no tokenizer of its own over ``nodes``, once it serves their models."""
        registry = ModelRegistry()
        fleet = self.fleet_of(nodes, models=ModelAdmission(registry), **fleet_options)
        api = OpenAIApi(
            self.reactor,
            fleet,
            None,
            "tiny-a",
            models=registry,
            seed_source=lambda: 7,
            workers=InlineWorkers(),  # type: ignore[arg-type]
        )
        self.addCleanup(api.stop)
        self.served(registry, [n.agent.config.model_name for n in nodes])
        return MemoryHead(fleet, api)

    def two_model_head(self, root: str) -> tuple[MemoryNode, MemoryNode, MemoryHead]:
        """Node a serving tiny-a (:data:`TEMPLATE_A`), node b serving tiny-b
        (:data:`TEMPLATE_B`, :data:`VOCAB_B`), their bundles written under ``root``, and a
        :meth:`model_head` over both."""
        a = self.start_model_node("a", "tiny-a", bundle_of(root, TEMPLATE_A))
        b = self.start_model_node("b", "tiny-b", bundle_of(root, TEMPLATE_B), VOCAB_B)
        return a, b, self.model_head([a, b])

    def served(self, registry: ModelRegistry, names: Sequence[str]) -> None:
        """Lets time pass until the registry serves ``names``."""
        self.until(lambda: all(registry.get(name) is not None for name in names))

    def chat(self, head: MemoryHead, model: str, max_tokens: int = 6) -> tuple[int, bytes]:
        return self.call(
            head,
            b"POST",
            "/v1/chat/completions",
            {"model": model, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0},
        )

    def test_two_models_each_answered_by_its_own_node_with_its_own_template(
        self,
    ) -> None:
        """Each node sends its files; /v1/models lists both with the node count and window;
        a chat names a model and is rendered with that model's template and generated on
        that model's node (its mock vocabulary shows in the tokens); an unknown model is a 404
        model_not_found."""
        root = self.mktemp()
        _, b, head = self.two_model_head(root)
        code, content = self.call(head, b"GET", "/v1/models")
        self.assertEqual(code, 200)
        listed = {m["id"]: m for m in json.loads(content)["data"]}
        self.assertEqual(set(listed), {"tiny-a", "tiny-b"})
        self.assertEqual((listed["tiny-a"]["nodes"], listed["tiny-b"]["nodes"]), (1, 1))
        self.assertEqual(listed["tiny-b"]["context_length"], b.engine.context_window)
        cases = (("tiny-a", TEMPLATE_A, TINY_VOCAB), ("tiny-b", TEMPLATE_B, VOCAB_B))
        for model, template, vocab in cases:
            code, content = self.chat(head, model)
            self.assertEqual(code, 200, content)
            body = json.loads(content)
            files = unpack_bundle(bundle_of(root, template).data)
            renderer = Renderer(HeadTokenizer.from_files(files))
            prompt = renderer.chat([ChatMessage("user", "hello world")])
            self.assertEqual(body["model"], model)
            self.assertEqual(body["usage"]["prompt_tokens"], len(prompt))
            self.assertEqual(
                body["choices"][0]["message"]["content"],
                renderer.decode(expected_tokens(prompt, 6, vocab)),
            )
        code, content = self.chat(head, "tiny-c")
        self.assertEqual(code, 404)
        self.assertEqual(json.loads(content)["error"]["code"], "model_not_found")
        code, _ = self.call(head, b"GET", "/v1/models/tiny-c")
        self.assertEqual(code, 404)

    def test_a_second_node_with_other_files_for_a_model_is_refused(
        self,
    ) -> None:
        """A node that names tiny-a with files other than those the head serves tiny-a with
        stays connected but is never placed on: every tiny-a request goes to the first."""
        root = self.mktemp()
        a = self.start_model_node("a", "tiny-a", bundle_of(root, TEMPLATE_A))
        head = self.model_head([a])
        impostor = self.start_model_node("x", "tiny-a", bundle_of(root, TEMPLATE_B))
        self.wait(head.fleet.add_node(impostor.endpoint))
        node = head.fleet.node_named("x")
        assert node is not None
        self.assertTrue(node.link.ready)
        self.assertFalse(node.live)
        reason = head.fleet.models.refusal(node.link)  # type: ignore[union-attr]
        assert reason is not None
        self.assertIn("differ from those this head serves tiny-a with", reason)
        self.assertEqual(len(head.fleet.live_nodes()), 1)
        for _ in range(3):
            code, _ = self.chat(head, "tiny-a")
            self.assertEqual(code, 200)
        self.assertEqual(node.sessions, 0)
        self.assertEqual(impostor.agent.status().capacity.active_sessions, 0)
        self.assertEqual(self.flushLoggedErrors(), [])

    def test_a_node_without_the_extension_needs_the_head_to_serve_its_model(
        self,
    ) -> None:
        """A node that sends no files (an older node) serves a model the head already serves,
        and is left out for one it does not (no request can name that model: 404)."""
        root = self.mktemp()
        a = self.start_model_node("a", "tiny-a", bundle_of(root, TEMPLATE_A))
        old_a = self.start_model_node("old-a", "tiny-a", None)
        old_c = self.start_model_node("old-c", "tiny-c", None)
        head = self.model_head([a])
        self.wait(head.fleet.add_node(old_a.endpoint))
        self.wait(head.fleet.add_node(old_c.endpoint))
        self.assertTrue(head.fleet.node_named("old-a").live)  # type: ignore[union-attr]
        self.assertFalse(head.fleet.node_named("old-c").live)  # type: ignore[union-attr]
        self.assertEqual(head.api.models.names(), ("tiny-a",))
        code, _ = self.chat(head, "tiny-c")
        self.assertEqual(code, 404)

    def test_files_that_do_not_match_their_hash_are_refused_and_the_link_stays(
        self,
    ) -> None:
        """A node whose files do not hash to what it offered is refused for its model (the
        head logs why) without losing its link, and the model is not served; a sound node of
        another model beside it is unaffected."""
        root = self.mktemp()
        sound = bundle_of(root, TEMPLATE_A)
        lying = Bundle(bundle_of(root, TEMPLATE_B).data, b"\x07" * 32)
        a = self.start_model_node("a", "tiny-a", sound)
        liar = self.start_model_node("x", "tiny-x", lying)
        head = self.model_head([a])
        self.wait(head.fleet.add_node(liar.endpoint))
        node = head.fleet.node_named("x")
        assert node is not None
        admission = head.fleet.models
        assert admission is not None
        self.until(lambda: not admission.fetching())
        self.assertTrue(node.link.ready)
        self.assertFalse(node.live)
        reason = admission.refusal(node.link)
        assert reason is not None
        self.assertIn("do not have the content hash", reason)
        self.assertEqual(head.api.models.names(), ("tiny-a",))
        code, _ = self.chat(head, "tiny-a")
        self.assertEqual(code, 200)

    def test_a_model_whose_nodes_are_gone_waits_for_one(self) -> None:
        """When tiny-b's only node has left the fleet, a tiny-b request waits in the queue
        (tiny-a is answered meanwhile), counted in tiny-b's waiting gauge, and is answered
        by the tiny-b node that joins next; a model the head never served fails at once."""
        root = self.mktemp()
        a = self.start_model_node("a", "tiny-a", bundle_of(root, TEMPLATE_A))
        head = self.model_head([a], queue_timeout_s=60.0)
        bundle_b = bundle_of(root, TEMPLATE_B)
        b = self.dial_in(head, "b", "tiny-b", bundle_b, VOCAB_B)
        self.served(head.api.models, ["tiny-b"])
        code, _ = self.chat(head, "tiny-b")
        self.assertEqual(code, 200)
        self.wait(b.close_connections("leaving"))
        self.until(lambda: head.fleet.node_named("b") is None)
        waiting = self.http(head)
        body = {"model": "tiny-b", "messages": MESSAGES, "max_tokens": 6, "temperature": 0}
        waiting.send(request_bytes("/v1/chat/completions", json.dumps(body).encode()))
        self.until(lambda: head.fleet.queued > 0)
        code, _ = self.chat(head, "tiny-a")
        self.assertEqual(code, 200)
        self.assertFalse(waiting.closed)
        self.assertEqual(head.api.status("tiny-b").model_waiting, 1)
        self.assertEqual(head.api.status("tiny-a").model_waiting, 0)
        self.wait_failure(head.fleet.open_session([1, 2, 3], model="tiny-z"), NoNodeAvailable)
        self.dial_in(head, "b2", "tiny-b", bundle_b, VOCAB_B)
        self.until(lambda: waiting.closed)
        code, _, content = response_of(waiting.data)
        self.assertEqual(code, 200, content)
        self.assertEqual(json.loads(content)["model"], "tiny-b")

    def test_metrics_export_the_gateway_gauges_per_model(self) -> None:
        """/metrics has vllm:num_requests_waiting, vllm:num_requests_running and the KV cache
        usage (both names) with one series per model, labelled model_name."""
        head = self.two_model_head(self.mktemp())[2]
        code, content = self.call(head, b"GET", "/metrics")
        self.assertEqual(code, 200)
        text = content.decode()
        for name in (
            "vllm:num_requests_waiting",
            "vllm:num_requests_running",
            "vllm:kv_cache_usage_perc",
            "vllm:gpu_cache_usage_perc",
        ):
            for model in ("tiny-a", "tiny-b"):
                self.assertRegex(text, rf'{name}{{model_name="{model}"}} \d')


class GaugeTests(SynchronousTestCase):
    """The gateway's gauges from per-model status snapshots (sfnode.head.api.gauges), pure."""

    def test_each_model_gets_its_series_and_kv_usage_is_a_fraction(self) -> None:
        """Waiting and running come from the model's status; KV usage is used over total
        blocks of its nodes (0 when none reported), under both vLLM names."""
        statuses = {
            "m1": BackendStatus(
                live_nodes=2, model_waiting=3, model_running=4,
                model_kv_blocks_used=512, model_kv_blocks_total=2048,
            ),
            "m2": BackendStatus(live_nodes=2),
        }  # fmt: skip
        samples = {
            (family.name, sample.labels["model_name"]): sample.value
            for family in gateway_gauges(statuses)
            for sample in family.samples
        }
        self.assertEqual(
            samples,
            {
                ("vllm:num_requests_waiting", "m1"): 3.0,
                ("vllm:num_requests_waiting", "m2"): 0.0,
                ("vllm:num_requests_running", "m1"): 4.0,
                ("vllm:num_requests_running", "m2"): 0.0,
                ("vllm:kv_cache_usage_perc", "m1"): 0.25,
                ("vllm:kv_cache_usage_perc", "m2"): 0.0,
                ("vllm:gpu_cache_usage_perc", "m1"): 0.25,
                ("vllm:gpu_cache_usage_perc", "m2"): 0.0,
            },
        )


class NodeFilesOptionTests(SynchronousTestCase):
    """Which files ``twistd sfnode`` offers its head (sfnode.node.tap.model_files)."""

    def options(self, *args: str) -> Any:
        from sfnode.node.tap import Options

        options = Options()
        options.parseOptions(["--listen", "tcp:0:interface=127.0.0.1", *args])
        return options

    def test_a_mock_node_offers_its_model_folder_and_is_named_after_it(self) -> None:
        """--engine mock --model FOLDER offers the folder's bundle and names the model after
        the folder; without --model it offers nothing and is 'mock'; a folder without
        tokenizer.json offers nothing."""
        from sfnode.node.tap import model_files

        root = self.mktemp()
        folder = tokenizer_folder(root, TEMPLATE_A)
        with_model = self.options("--engine", "mock", "--model", str(folder))
        self.assertEqual(model_files(with_model), bundle_of(root, TEMPLATE_A))
        self.assertEqual(with_model["model-name"], folder.name)
        plain = self.options("--engine", "mock")
        self.assertIsNone(model_files(plain))
        self.assertEqual(plain["model-name"], "mock")
        empty = Path(root) / "empty-model"
        empty.mkdir(parents=True)
        self.assertIsNone(model_files(self.options("--engine", "mock", "--model", str(empty))))


class _Link:
    """What ModelAdmission reads of a link, with a real FilesFetch and the messages it sent."""

    def __init__(self, name: str, model: str, content_hash: bytes) -> None:
        self.name = name
        self.models = (model,)
        self.connected = True
        self.hello_ack = HelloAckF(
            2, name, CapacitySummary(), (model,), FEATURE_MODEL_FILES, LinkFLimits(),
            ModelFilesOffer(content_hash, 0),
        )  # fmt: skip
        self.files = FilesFetch()
        self.sent: list[Any] = []

    def send_now(self, message: Any) -> bool:
        self.sent.append(message)
        return True

    def send_files(self, bundle: Bundle) -> None:
        for message in transfer_messages(bundle, 1):
            self.files.receive(message)


class AdmissionTests(SynchronousTestCase):
    """ModelAdmission over links whose transfers the test plays (no sockets, no reactor)."""

    def setUp(self) -> None:
        root = self.mktemp()
        self.honest = bundle_of(root, TEMPLATE_A)
        self.admission = ModelAdmission(ModelRegistry())
        self.changed: list[Any] = []
        self.admission.changed = self.changed.append

    def test_one_fetch_per_hash_and_a_liar_costs_only_itself(self) -> None:
        """Two nodes offer the same files: only the first is asked; it sends other bytes and
        is refused, the second is asked next, and once its files are read both the model
        and that node are served."""
        liar = _Link("liar", "m", self.honest.content_hash)
        good = _Link("good", "m", self.honest.content_hash)
        self.assertFalse(self.admission.judge(liar))  # type: ignore[arg-type]
        self.assertFalse(self.admission.judge(good))  # type: ignore[arg-type]
        self.assertEqual(liar.sent, [BlobFetchMsg(self.honest.content_hash)])
        self.assertEqual(good.sent, [])
        liar.send_files(Bundle(bundle_of(self.mktemp(), TEMPLATE_B).data, self.honest.content_hash))
        self.assertIn("do not have the content hash", self.admission.refusal(liar) or "")  # type: ignore[arg-type]
        self.assertEqual(good.sent, [BlobFetchMsg(self.honest.content_hash)])
        good.send_files(self.honest)
        self.assertTrue(self.admission.admits(good))  # type: ignore[arg-type]
        self.assertFalse(self.admission.admits(liar))  # type: ignore[arg-type]
        self.assertIn(good, self.changed)
        self.assertTrue(self.admission.knows("m"))

    def test_a_transfer_cut_off_is_no_refusal_and_the_next_node_is_asked(self) -> None:
        """The link of the node asked is lost mid-transfer: it is not refused (it is asked
        again at its next handshake), and the next node offering the files is asked."""
        first = _Link("first", "m", self.honest.content_hash)
        second = _Link("second", "m", self.honest.content_hash)
        self.admission.judge(first)  # type: ignore[arg-type]
        self.admission.judge(second)  # type: ignore[arg-type]
        first.files.fail(LinkError("the connection to first ended"))
        self.assertIsNone(self.admission.refusal(first))  # type: ignore[arg-type]
        self.assertEqual(len(second.sent), 1)
        second.send_files(self.honest)
        self.assertTrue(self.admission.admits(second))  # type: ignore[arg-type]
        self.assertFalse(self.admission.judge(_Link("x", "m", b"\x09" * 32)))  # type: ignore[arg-type]
