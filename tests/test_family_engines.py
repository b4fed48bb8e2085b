"""Every family served by the real engine, built by the node's own builder (docs/engine.md
section 5.4): each family's tiny model (``tests/families.py``) from its folder and from its GGUF
files (F32, Q8_0, Q4_K_M), through sfnode's native step and through the layers as torch
operators, gives the greedy tokens of transformers' ``generate()``: on the folder in float32 for
the folder and the F32 file, all 48; over the file's dequantized matrices for the quantized
files, with the activations rounded as the kernels round them, up to a near tie of the
reference's (the figures of their agreement with float32 are ``bench/families.py``'s).  K-quant
files are held as stored (the engine's figure, its log line and ``/metrics``); a Llama 3 GGUF
answers as its folder; an architecture sfnode does not read is refused by name before the node
exists or dials a head; the chat template comes from the model.

The models are tiny (two layers of 256; Gemma 3 six), so the whole matrix takes seconds a
family.  These tests must never download anything.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from twisted.internet import defer, reactor, task
from twisted.logger import capturedLogs, formatEvent
from twisted.trial import unittest

from sfnode.engines.kernels import native
from sfnode.generation import GenerationRequest
from sfnode.linkf.wire import GenParams
from sfnode.node import tap
from tests import families
from tests.tinymodel import reference_greedy

PROMPT = [1, 37, 90, 200, 15, 8, 301, 78]
"""A prompt after which no family and kind of file reaches its EOS within :data:`TOKENS`
tokens (the tiny models often do), so each comparison is of 48 tokens."""
TOKENS = 48
KINDS = ("folder", "F32", "Q8_0", "Q4_K_M")
LOOPBACK = "tcp:0:interface=127.0.0.1"
_cache = Path(families._workspace()) / "cache"
"""The model cache of every node and engine of this module whose subject is not the cache (so
the native library is compiled, and each file converted, once per run)."""


def source(family: str, kind: str) -> Path:
    return families.folder(family) if kind == "folder" else families.gguf(family, kind)


def transformers_model(family: str, window: bool = True) -> Any:
    """The folder's transformers model in float32 (without its sliding window: what a Mistral
    GGUF file holds, its converter dropping the window)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = families.folder(family)
    config = AutoConfig.from_pretrained(str(folder))
    if not window:
        config.sliding_window = None
    model = AutoModelForCausalLM.from_pretrained(
        str(folder), config=config, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def reference(family: str, kind: str) -> Any:
    """transformers' float32 model of ``family``'s ``kind``: the folder's; for a quantized file
    with the file's matrices dequantized in it, multiplying the activations as the block
    kernels hold them (16 bits a value, a scale per block of 32: ``tests/reference.py``)."""
    key = (family, kind)
    if key not in _MODELS:
        from sfnode.engines.weights.stored import read_gguf
        from tests.reference import with_kernel_activations, with_stored_matrices

        # llama.cpp's converter writes a Mistral model without its window.
        model = transformers_model(family, window=not (family == "mistral" and kind != "folder"))
        if kind in QUANTIZED:
            model = with_stored_matrices(model, read_gguf(source(family, kind)))
            model = with_kernel_activations(model)
        _MODELS[key] = model
    return _MODELS[key]


def expected(family: str, kind: str) -> list[int]:
    """The greedy tokens of :func:`reference` after :data:`PROMPT`."""
    key = (family, kind)
    if key not in _EXPECTED:
        _EXPECTED[key] = reference_greedy(reference(family, kind), PROMPT, TOKENS)
    return _EXPECTED[key]


def tie(family: str, kind: str, tokens: list[int], at: int) -> float:
    """How far apart, relative to the largest logit, the reference puts its own token and
    ``tokens[at]`` after :data:`PROMPT` and ``tokens[:at]``."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([PROMPT + tokens[:at]])
        logits = reference(family, kind)(ids).logits[0, -1]
    gap = logits.max() - logits[tokens[at]]
    return float(gap / logits.abs().max())


_MODELS: dict[tuple[str, str], Any] = {}
_EXPECTED: dict[tuple[str, str], list[int]] = {}
QUANTIZED = ("Q8_0", "Q4_K_M")
NEAR_TIE = 1e-3
"""A quantized file's greedy tokens may leave the reference's where its best two logits are
this close (relative to the largest): an activation's 16-bit rounding falls the other way when
the float sums before it differ in their last bit, which moves a logit by about 1e-4 of its
size (docs/engine.md section 5.4)."""


def build(path: Path, *extra: str) -> Any:
    """The engine ``twistd sfnode --model path`` builds (one lane, one thread)."""
    options = tap.Options()
    options.parseOptions(
        [
            "--listen",
            "tcp:0:interface=127.0.0.1",
            "--model",
            str(path),
            "--device",
            "cpu",
            "--threads",
            "1",
            "--max-lanes",
            "1",
            "--cache-dir",
            str(_cache),
            *extra,
        ]
    )
    return tap.build_engine(reactor, options)


def native_kernels() -> None:
    """Skip where sfnode's kernels cannot be built or loaded here."""
    from sfnode.engines.weights.loading import default_cache_dir

    loaded = native.load(default_cache_dir().parent / "kernels")
    if isinstance(loaded, str):
        raise unittest.SkipTest(f"no native kernels on this machine: {loaded}")


class FamilyEngineTests(unittest.TestCase):
    """Each family and kind of file through the engine the node builds."""

    tokens: ClassVar[dict[tuple[str, str, str], list[int]]] = {}

    @defer.inlineCallbacks
    def greedy(self, engine: Any) -> Any:
        """The engine's first greedy tokens after :data:`PROMPT`."""
        engine.start()
        try:
            request = GenerationRequest(list(PROMPT), GenParams(), TOKENS, 0)
            result = yield engine.submit(request, lambda *args: None).result
        finally:
            yield engine.stop()
        return list(result.tokens)

    @defer.inlineCallbacks
    def check_path(self, path: str, options: dict[str, tuple[str, ...]], fused: bool) -> Any:
        """Every family and kind, built with ``options`` (by kind), gives ``expected``'s 48
        tokens, through the native step where ``fused``: every one for a float model; for a
        quantized file every one up to a near tie of the reference's (:data:`NEAR_TIE`), where
        the engine's token is the reference's second best."""
        for family in families.FAMILY_NAMES:
            for kind in KINDS:
                engine = build(source(family, kind), *options[kind])
                where = (family, kind, path)
                self.assertEqual(engine.fused_step, fused, where)
                self.tokens[where] = got = yield self.greedy(engine)
                want = expected(family, kind)
                self.assertEqual(len(want), TOKENS, where)
                self.assertGreater(len(set(want)), 4, where)
                if kind not in QUANTIZED or got == want:
                    self.assertEqual(got, want, where)
                    continue
                at = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
                self.assertEqual(got[:at], want[:at], where)
                self.assertLess(tie(family, kind, got, at), NEAR_TIE, (where, at))

    def test_every_family_and_kind_through_the_native_step(self) -> Any:
        """sfnode's kernels and its native step (docs/engine.md section 5.2) serve every
        family from its folder and its F32, Q8_0 and Q4_K_M files, and give transformers'
        greedy tokens (on the folder in float32; over the file's dequantized matrices)."""
        native_kernels()
        options = {kind: ("--kernels", "native") for kind in KINDS}
        return self.check_path("native", options, fused=True)

    def test_every_family_and_kind_through_torch_operators(self) -> Any:
        """With the layers as torch operators (--eager-step), the float files multiplied by
        torch's own kernels (float32, oneDNN) and the quantized ones by sfnode's kernels from
        their blocks, every family and kind gives the same tokens as transformers."""
        native_kernels()
        float_files = ("--kernels", "torch", "--eager-step")
        blocks = ("--kernels", "native", "--eager-step")
        options = {"folder": float_files, "F32": float_files, "Q8_0": blocks, "Q4_K_M": blocks}
        return self.check_path("torch", options, fused=False)

    @defer.inlineCallbacks
    def test_a_llama3_gguf_answers_as_its_folder(self) -> Any:
        """A Llama 3 model (rope_type llama3) converted to GGUF (its factors as the
        ``rope_freqs`` tensor, the rope type the converter writes) answers what its folder
        answers, through the node's engine, by default options."""
        from sfnode.engines.weights.stored import read_gguf

        path = families.gguf("llama", "F32")
        self.assertEqual(read_gguf(path).spec.rope.scaling, "llama3")
        from_folder = yield self.greedy(build(families.folder("llama")))
        from_file = yield self.greedy(build(path))
        self.assertEqual(from_file, from_folder)
        self.assertEqual(from_folder, expected("llama", "folder"))

    def test_k_quant_files_are_held_as_stored(self) -> None:
        """A Q4_K_M file's matrices are multiplied from their Q4_K and Q6_K blocks (the
        engine's account of its kernels names them), and the weights the step reads take at
        most 1.1 times the file's size, by the engine's own figures (what its log line and
        ``/metrics`` show)."""
        native_kernels()
        for family in families.FAMILY_NAMES:
            path = families.gguf(family, "Q4_K_M")
            with capturedLogs() as events:
                engine = build(path)
            kinds = {part.split(" x ")[0] for part in engine.weights.kernels.split(", ")}
            self.assertEqual(kinds, {"Q4_K", "Q6_K"}, family)
            figures = engine.statistics().weights
            self.assertIsNotNone(figures, family)
            assert figures is not None
            self.assertEqual(figures.file_bytes, path.stat().st_size, family)
            self.assertEqual(figures.held_bytes, engine.weights.gathered.held_bytes(), family)
            self.assertGreater(figures.ratio, 0.5, family)
            self.assertLessEqual(figures.ratio, 1.1, family)
            (line,) = [formatEvent(e) for e in events if "layers of" in (formatEvent(e) or "")]
            self.assertIn(f"{figures.ratio:.2f}x", line, family)
            self.assertIn(f"{engine.weights.kernels}; ", line, family)

    @defer.inlineCallbacks
    def test_a_resting_engine_gives_back_the_rows_it_read(self) -> Any:
        """The tables read a row at a time (the embedding, the head's float rows) are read
        from the file with ``pread``: a generation leaves none of their map's pages resident,
        and the rows read are the mapped ones (the answer is the same as through the map, the
        tests of exactness check that).  Pages read through the map (as a check of them does)
        are given back :data:`REST_AFTER_S` after a generation ended (and after a rest asked
        for); the engine's figures count the weights' resident bytes without them.  The head's
        float rows of this file share the map its Q6_K head is multiplied from whole at every
        step (kept as stored): those pages stay resident through a rest."""
        import mmap

        from sfnode.engines.kernels.blocks import dequantize
        from sfnode.engines.kernels.maps import resident_bytes
        from sfnode.engines.kernels.native import BlockLinear
        from sfnode.engines.transformers_engine import REST_AFTER_S
        from sfnode.engines.weights.gather import StoredRows

        native_kernels()
        engine = build(families.gguf("llama", "Q4_K_M"))
        gathered = engine.weights.gathered
        tables = gathered.row_tables()
        self.assertEqual(len(tables), 1)
        self.assertIs(tables[0], gathered.embed)
        head = gathered.lm_head_float
        assert isinstance(head, StoredRows) and isinstance(gathered.lm_head, BlockLinear)
        self.assertFalse(gathered.lm_head.tiled)
        address, page = head.data.ctypes.data, mmap.PAGESIZE
        spanned = ((address + head.data.nbytes - 1) // page - address // page + 1) * page
        engine.start()
        self.addCleanup(engine.stop)
        request = GenerationRequest(list(PROMPT), GenParams(), TOKENS, 0)
        yield engine.submit(request, lambda *args: None).result
        self.assertEqual([resident_bytes(table.data) for table in tables], [0])
        for table in tables:
            assert isinstance(table, StoredRows) and table.file is not None
            rows = table[torch.tensor([1, 7])]
            self.assertEqual(resident_bytes(table.data), 0)
            mapped = dequantize(table.kind, np.asarray(table.data[[1, 7]]), table.shape[1])
            np.testing.assert_array_equal(rows.numpy(), mapped)
            self.assertGreater(resident_bytes(table.data), 0)
        # The engine rests once out of work for a while, not at once.
        yield task.deferLater(reactor, REST_AFTER_S + 0.2, lambda: None)
        yield engine.worker.call(lambda: None)
        self.assertEqual([resident_bytes(table.data) for table in tables], [0])
        self.assertEqual(resident_bytes(head.data), spanned)
        for table in tables:
            int(np.asarray(table.data[[1, 7]]).sum())
            self.assertGreater(resident_bytes(table.data), 0)
        engine.worker.rest()
        yield task.deferLater(reactor, REST_AFTER_S + 0.2, lambda: None)
        yield engine.worker.call(lambda: None)
        self.assertEqual([resident_bytes(table.data) for table in tables], [0])
        self.assertEqual(resident_bytes(head.data), spanned)
        figures = engine.statistics().weights
        held = gathered.held_bytes()
        self.assertEqual(figures.held_bytes, held)
        self.assertEqual(figures.resident_bytes, held - sum(t.nbytes for t in tables))

    def test_a_freed_large_block_leaves_the_resident_set(self) -> None:
        """Once a node's engine is built, a large block freed (as a step frees its
        temporaries) leaves the resident set at once, not when the engine next rests: glibc's
        thresholds stay at their first value, even where a large map freed before (as packing
        weights frees them) had raised them."""
        import ctypes
        import ctypes.util

        from sfnode.node.host import resident_bytes

        name = ctypes.util.find_library("c")
        libc = ctypes.CDLL(name) if name else None
        if libc is None or not hasattr(libc, "mallopt") or resident_bytes() is None:
            raise unittest.SkipTest("not glibc on Linux")
        libc.malloc.restype = ctypes.c_void_p
        libc.free.argtypes = [ctypes.c_void_p]
        libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]

        def touched(size: int) -> int:
            block = libc.malloc(size)
            assert block
            libc.memset(block, 1, size)
            return int(block)

        libc.free(touched(24 << 20))  # a freed map of its own: glibc raises its thresholds
        build(families.gguf("llama", "Q8_0"))
        before = resident_bytes()
        libc.free(touched(8 << 20))
        after = resident_bytes()
        assert before is not None and after is not None
        self.assertLess(after - before, 1 << 20)

    @defer.inlineCallbacks
    def test_metrics_show_the_weights_against_their_file(self) -> Any:
        """A node serving a Q4_K_M file shows on ``/metrics`` the bytes of the weights its
        step reads and the file's, within 1.1x of each other, and its resident memory split
        into the weights' resident pages, the keys and values and the rest."""
        from twisted.web.client import Agent, readBody

        from sfnode.engines.weights.stored import read_gguf

        native_kernels()
        path = families.gguf("qwen2", "Q4_K_M")
        options = tap.Options()
        options.parseOptions(
            ["--listen", "tcp:0:interface=127.0.0.1", "--model", str(path), "--device", "cpu",
             "--threads", "1", "--max-lanes", "1", "--cache-dir", str(_cache),
             "--metrics", "tcp:0:interface=127.0.0.1"]
        )  # fmt: skip
        node = tap.makeService(options, reactor)
        node.startService()
        self.addCleanup(node.stopService)
        port = node.getServiceNamed("metrics").port.getHost().port
        response = yield Agent(reactor).request(b"GET", f"http://127.0.0.1:{port}/metrics".encode())
        body = (yield readBody(response)).decode()
        found = {
            name: float(value)
            for name, value in re.findall(r"^(sfnode_weights(?:_file)?_bytes)\{[^}]*\} (\S+)$",
                                          body, re.M)
        }  # fmt: skip
        self.assertEqual(found["sfnode_weights_file_bytes"], path.stat().st_size)
        self.assertLessEqual(found["sfnode_weights_bytes"], 1.1 * path.stat().st_size)
        self.assertGreater(found["sfnode_weights_bytes"], 0.5 * path.stat().st_size)
        parts = {
            part: float(value)
            for part, value in re.findall(r"^sfnode_resident_(\w+)_bytes\{[^}]*\} (\S+)$",
                                          body, re.M)
        }  # fmt: skip
        (resident,) = re.findall(r"^sfnode_resident_bytes\{[^}]*\} (\S+)$", body, re.M)
        # The weights' resident pages: all but those of the tables read a row at a time
        # that no step read since the engine last rested (the embedding, tied to the head).
        embed = read_gguf(path).tensors["embed"].data.nbytes
        self.assertLessEqual(parts["weights"], found["sfnode_weights_bytes"])
        self.assertGreaterEqual(parts["weights"], found["sfnode_weights_bytes"] - embed)
        self.assertGreaterEqual(parts["kv"], 0.0)
        self.assertGreater(parts["rest"], 0.0)
        self.assertEqual(sum(parts.values()), float(resident))

    def test_an_unsupported_architecture_is_refused_by_name(self) -> None:
        """A GGUF file of an architecture no family reads is refused at start in one line
        naming it, and leaves nothing in the model cache; the node it builds holds no model:
        its HELLO_ACK_F names none, offers no files and carries the refusal (D25), and a
        generation asked of it anyway is refused with the reason."""
        from sfnode.generation import EngineRefusal

        path = mamba_file(self)
        cache = Path(self.mktemp())
        options = tap.Options()
        options.parseOptions(
            ["--listen", "tcp:0:interface=127.0.0.1", "--model", str(path), "--cache-dir",
             str(cache)]
        )  # fmt: skip
        with capturedLogs() as events:
            node = tap.makeService(options, reactor)
        lines = [formatEvent(e) for e in events]
        self.assertEqual([line for line in lines if "mamba" in line], [REFUSED], lines)
        self.assertFalse([p for p in cache.rglob("*") if p.is_file()])
        agent = node.getServiceNamed("agent").agent
        ack = agent.reports.hello_ack()
        self.assertEqual(
            (ack.loadable_models, ack.model_files, ack.refused),
            ((), None, REFUSED.removeprefix("sfnode: ")),
        )
        self.assertEqual(agent.reports.status().loadable_models, ())
        refused = agent.engine.submit(GenerationRequest([1, 2], GenParams(), 4), print)
        self.failureResultOf(refused.result, EngineRefusal)


REFUSED = (
    "sfnode: GGUF architecture 'mamba' is not supported (sfnode reads llama, qwen2, qwen3, "
    "gemma2, gemma3, phi3)"
)


def mamba_file(test: unittest.TestCase) -> Path:
    """:func:`mamba_file_at` in a folder of ``test``'s own."""
    return mamba_file_at(Path(test.mktemp()).resolve())


def mamba_file_at(folder: Path) -> Path:
    """The tiny Qwen2 F32 file with its architecture renamed ``mamba`` (one no family reads),
    written in ``folder``."""
    path = folder / "mamba.gguf"
    path.parent.mkdir(parents=True, exist_ok=True)
    data = bytearray(families.gguf("qwen2", "F32").read_bytes())
    at = data.index(b"qwen2")
    data[at : at + 5] = b"mamba"
    path.write_bytes(bytes(data))
    return path


class RefusedNodeProcessTests(unittest.TestCase):
    """``twistd sfnode`` as an operator starts it, joining a real ``twistd sfhead``."""

    timeout = 120

    async def test_a_refused_node_shows_as_refused_at_its_head(self) -> None:
        """A node told to join a head (``--head``) with a model of an architecture sfnode
        does not read says so in one line at start (no traceback), then shakes hands naming no
        model and telling why (D25): the head logs it as refused with the reason, its
        ``/metrics`` has ``sfhead_node_refused{node,reason}`` 1 and no ``sfhead_node_up`` of
        1, ``/healthz`` counts no node serving (``unavailable``, 0 nodes) and ``/v1/models``
        lists no model of the node's."""
        from twisted.web.client import Agent, readBody

        from tests.processes import Child, spawn_twistd

        head = spawn_twistd(
            self,
            Child("head"),
            ["sfhead", "--http", LOOPBACK, "--fleet-listen", LOOPBACK, "--model-name", "other"],
        )
        found = await head.wait_for(rb"sfhead serving HTTP on 127\.0\.0\.1:(\d+)\n")
        http = int(found[0].group(1))
        found = await head.wait_for(rb"sfhead accepting nodes on 127\.0\.0\.1:(\d+)\n")
        fleet = int(found[0].group(1))
        path = mamba_file(self)
        node = spawn_twistd(
            self,
            Child("node"),
            ["sfnode", "--head", f"tcp:127.0.0.1:{fleet}", "--identity", "refusing",
             "--model", str(path), "--cache-dir", str(path.parent / "cache"), "--device", "cpu"],
        )  # fmt: skip
        reason = REFUSED.removeprefix("sfnode: ")
        await head.wait_for(
            rb"node refusing joined \(dialed in from [^)]*\) refusing its model: "
            + re.escape(reason.encode())
            + rb"; it stays connected but serves nothing"
        )
        text = bytes(node.output).decode(errors="replace")
        said = [line for line in text.splitlines() if "mamba" in line]
        self.assertEqual(len(said), 1, text)
        self.assertTrue(said[0].endswith(REFUSED), text)
        self.assertNotIn("Traceback", text)
        agent = Agent(reactor)
        response = await agent.request(b"GET", f"http://127.0.0.1:{http}/healthz".encode())
        health = json.loads(await readBody(response))
        self.assertEqual(
            (response.code, health["status"], health["nodes"]), (503, "unavailable", 0)
        )
        response = await agent.request(b"GET", f"http://127.0.0.1:{http}/metrics".encode())
        metrics = (await readBody(response)).decode()
        self.assertIn(f'sfhead_node_refused{{node="refusing",reason="{reason}"}} 1.0', metrics)
        self.assertNotRegex(metrics, r"sfhead_node_up\{[^}]*\} 1")
        response = await agent.request(b"GET", f"http://127.0.0.1:{http}/v1/models".encode())
        models = [m["id"] for m in json.loads(await readBody(response))["data"]]
        self.assertNotIn("mamba", models)
        self.assertFalse([m for m in models if m != "other"], models)


class NoTemplateProcessTests(unittest.TestCase):
    """A model without a chat template, served by a real ``twistd sfnode`` to a real
    ``twistd sfhead`` that has no files of its own."""

    timeout = 120

    async def test_chat_is_refused_and_completions_served(self) -> None:
        """A Qwen2 GGUF written without ``tokenizer.chat_template``: the node converts it and
        sends the head its files (no template among them); chat on /v1/chat/completions,
        /v1/responses and /v1/messages is a 400 naming the model and saying it has no chat
        template, and /v1/completions answers 200 with text."""
        from io import BytesIO

        from twisted.web.client import Agent, FileBodyProducer, readBody
        from twisted.web.http_headers import Headers

        from tests.processes import Child, spawn_twistd

        where = Path(self.mktemp()).resolve()
        where.mkdir(parents=True)
        path = families.write_gguf(
            "qwen2", families.folder("qwen2"), where / "bare.gguf", "F32", None
        )
        head = spawn_twistd(
            self, Child("head"), ["sfhead", "--http", LOOPBACK, "--fleet-listen", LOOPBACK]
        )
        found = await head.wait_for(rb"sfhead serving HTTP on 127\.0\.0\.1:(\d+)\n")
        http = int(found[0].group(1))
        found = await head.wait_for(rb"sfhead accepting nodes on 127\.0\.0\.1:(\d+)\n")
        fleet = int(found[0].group(1))
        spawn_twistd(
            self,
            Child("node"),
            ["sfnode", "--head", f"tcp:127.0.0.1:{fleet}", "--model", str(path),
             "--cache-dir", str(_cache), "--device", "cpu", "--threads", "1"],
        )  # fmt: skip
        await head.wait_for(rb"installed the model files")
        agent = Agent(reactor)

        async def post(route: str, body: dict[str, Any]) -> tuple[int, Any]:
            response = await agent.request(
                b"POST",
                f"http://127.0.0.1:{http}{route}".encode(),
                Headers({b"content-type": [b"application/json"]}),
                FileBodyProducer(BytesIO(json.dumps(body).encode())),
            )
            return response.code, json.loads(await readBody(response))

        messages = [{"role": "user", "content": "hello"}]
        for route, body in [
            ("/v1/chat/completions", {"model": "bare", "messages": messages}),
            ("/v1/responses", {"model": "bare", "input": "hello"}),
            ("/v1/messages", {"model": "bare", "max_tokens": 4, "messages": messages}),
        ]:
            code, answer = await post(route, body)
            self.assertEqual(code, 400, (route, answer))
            self.assertIn("The model bare has no chat template", answer["error"]["message"])
        code, answer = await post(
            "/v1/completions",
            {"model": "bare", "prompt": PROMPT, "max_tokens": 4, "temperature": 0},
        )
        self.assertEqual(code, 200, answer)
        self.assertEqual(answer["usage"]["completion_tokens"], 4)


TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{{ messages[0]['content'] if messages[0]['role'] == 'system' else 'You help.' }}\n\n"
    "# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n"
    "{{ messages[0]['content'] }}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant"
    "{% if message.content %}\n{{ message.content }}{% endif %}"
    "{% for call in message.tool_calls %}{% set f = call.function %}\n<tool_call>\n"
    '{"name": "{{ f.name }}", "arguments": {{ f.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A chat template in the shape of Qwen2.5's: the tools as JSON in the system turn, calls and
results in their tags, consecutive results in one user turn."""


class ChatTemplateTests(unittest.TestCase):
    """The chat template a model brings, from the node's model files to the head's rendering."""

    def model_files(self, template: str | None) -> tuple[Path, Path]:
        """A tiny Qwen2 GGUF with ``template`` and the folder of model files the node writes
        for it (in the module's cache, where :func:`build` finds them)."""
        from sfnode.engines.weights.loading import model_folder

        where = Path(self.mktemp()).resolve()
        where.mkdir(parents=True)
        path = families.write_gguf(
            "qwen2", families.folder("qwen2"), where / "qwen2.gguf", "F32", template
        )
        return path, model_folder(path, _cache)[1]

    def test_a_gguf_template_with_tools_renders_as_transformers_renders_it(self) -> None:
        """A GGUF file's ``tokenizer.chat_template`` (one that reads ``tools``, calls and
        results) reaches the head through the node's model files, and the head renders a
        conversation with tools, a call and two results exactly as transformers'
        ``apply_chat_template`` renders it from the same files; so does the folder's
        ``tokenizer_config.json`` template."""
        from transformers import AutoTokenizer

        from sfnode.head.models.text import HeadTokenizer, TransformersCodec
        from tests.test_head_tools import TOOLS, RenderingTests

        _, folder = self.model_files(TOOLS_TEMPLATE)
        bare = Path(self.mktemp()).resolve()
        bare.mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (folder / name).is_file():
                (bare / name).write_bytes((folder / name).read_bytes())
        (bare / "chat_template.jinja").unlink(missing_ok=True)
        config = json.loads((bare / "tokenizer_config.json").read_text())
        (bare / "tokenizer_config.json").write_text(
            json.dumps({**config, "chat_template": TOOLS_TEMPLATE})
        )
        for where in (folder, bare):
            ours = HeadTokenizer(where)
            self.assertEqual(ours.chat_template, TOOLS_TEMPLATE, where)
            self.assertTrue(ours.knows_tools, where)
            theirs = TransformersCodec(AutoTokenizer.from_pretrained(str(where)))
            history = RenderingTests.HISTORY
            text = ours.render_chat(history, tools=TOOLS)
            self.assertEqual(text, theirs.render_chat(history, tools=TOOLS), where)
            # transformers' Jinja trims the newline after a block tag (trim_blocks)
            self.assertIn('<tools>{"type": "function", "function": {"name": "jump"', text)
            self.assertIn('"arguments": {"over": "fox"}}', text)
            self.assertEqual(ours.render_chat(history[:2]), theirs.render_chat(history[:2]))

    @defer.inlineCallbacks
    def test_a_model_without_a_template_still_serves_completions(self) -> Any:
        """A GGUF file with no chat template gives model files without one (the head has no
        template of the model's to render chat with) and an engine that still serves
        completions from token ids."""
        from sfnode.head.models.text import HeadTokenizer

        path, folder = self.model_files(None)
        self.assertFalse((folder / "chat_template.jinja").exists())
        self.assertIsNone(HeadTokenizer(folder).chat_template)
        engine = build(path)
        tokens = yield FamilyEngineTests().greedy(engine)
        self.assertEqual(len(tokens), TOKENS)
