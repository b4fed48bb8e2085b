"""The embedding engine: a sentence-transformers model through transformers, on one worker
thread (docs/protocol.md section 12.7; docs/engine.md section 9).

A sentence-transformers folder holds a transformer (``config.json``, the weights, the
tokenizer) and a list of modules (``modules.json``): a pooling (``1_Pooling/config.json``:
the mean of the tokens' last hidden states under the attention mask, the first token's, or
their maximum) and often a normalization (the vector scaled to length 1).
:func:`read_pooling` reads them, refusing by name any module it does not implement (a
``Dense`` projection, another pooling mode), so that an answer is what sentence-transformers
itself gives.  ``sentence_bert_config.json``'s ``max_seq_length`` bounds the tokens a text
is cut to.

:class:`EmbeddingEngine` is an :class:`~sfnode.generation.Engine` that generates nothing (every
generation is refused: its node sets ``FEATURE_EMBEDDINGS`` and its head places none on it)
and an :class:`~sfnode.generation.Embedder`: the texts of one EMBED_REQ are tokenized together,
run through the model in batches of :data:`BATCH` on the worker thread, pooled and normalized
as the folder says, and come back as float32 little-endian bytes.

This module must never touch the model outside its worker thread, and never call the node
from it (the result crosses back through ``deferToThreadPool``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twisted.internet import defer
from twisted.internet.threads import deferToThreadPool
from twisted.python.threadpool import ThreadPool

from sfnode.generation import (
    Embedded,
    EmbeddingError,
    EngineRefusal,
    EngineStatistics,
    GenerationRequest,
    GenerationResult,
    StageForwardError,
    StageResult,
    TokenSink,
)

BATCH = 32
"""Texts run through the model at once (a longer EMBED_REQ runs in several passes)."""
MODULES_FILE = "modules.json"
"""What makes a folder a sentence-transformers model."""

_POOLING_MODES = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
}
_TRANSFORMER = "sentence_transformers.models.Transformer"
_POOLING = "sentence_transformers.models.Pooling"
_NORMALIZE = "sentence_transformers.models.Normalize"


class EmbeddingModelError(Exception):
    """A folder that is no sentence-transformers model this engine runs."""


@dataclass(frozen=True)
class Pooling:
    """How a sentence-transformers folder turns hidden states into one vector."""

    mode: str
    """``mean``, ``cls`` or ``max``."""
    normalize: bool
    max_length: int | None
    """Tokens a text is cut to (None: the model's own bound)."""


def is_embedding_folder(folder: str | Path) -> bool:
    """Whether ``folder`` is a sentence-transformers model (it has ``modules.json``)."""
    return (Path(folder) / MODULES_FILE).is_file()


def read_pooling(folder: str | Path) -> Pooling:
    """The pooling, normalization and length bound a sentence-transformers folder declares.

    :raises EmbeddingModelError: a module or pooling mode this engine does not implement, or
        files that cannot be read.
    """
    root = Path(folder)
    try:
        modules = json.loads((root / MODULES_FILE).read_text(encoding="utf-8"))
        mode, normalize = None, False
        for module in modules:
            kind = module.get("type")
            if kind == _POOLING:
                config = json.loads((root / module["path"] / "config.json").read_text())
                chosen = [name for key, name in _POOLING_MODES.items() if config.get(key)]
                others = [k for k, v in config.items() if k.startswith("pooling_mode") and v]
                if len(chosen) != 1 or len(others) != 1:
                    raise EmbeddingModelError(f"pooling {others} is not supported")
                mode = chosen[0]
            elif kind == _NORMALIZE:
                normalize = True
            elif kind != _TRANSFORMER:
                raise EmbeddingModelError(f"the module {kind!r} is not supported")
        if mode is None:
            raise EmbeddingModelError(f"{root} declares no pooling")
        bert = root / "sentence_bert_config.json"
        limit = json.loads(bert.read_text()).get("max_seq_length") if bert.is_file() else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise EmbeddingModelError(f"cannot read the modules of {root}: {e}") from e
    return Pooling(mode, normalize, limit if isinstance(limit, int) and limit > 0 else None)


class _Refused:
    """A generation refused at once: an embedding model generates nothing."""

    def __init__(self) -> None:
        self.result: defer.Deferred[GenerationResult] = defer.fail(
            EngineRefusal("this node serves an embedding model: it generates nothing")
        )

    def cancel(self) -> None:
        pass  # nothing runs


class EmbeddingEngine:
    """An embedding model on one worker thread (see the module's docstring)."""

    path = "transformers (an embedding model)"

    def __init__(self, reactor: Any, model: Any, tokenizer: Any, pooling: Pooling) -> None:
        self._reactor = reactor
        self._model = model
        self._tokenizer = tokenizer
        self.pooling = pooling
        config = model.config
        bound = getattr(config, "max_position_embeddings", 0) or 0
        self._max_length = min(x for x in (pooling.max_length, bound or None, 1 << 20) if x)
        self._dim = int(config.hidden_size)
        self._pool = ThreadPool(minthreads=1, maxthreads=1, name="sfnode-embedding")
        self._running = False
        self._tokens = 0

    @classmethod
    def from_folder(
        cls, reactor: Any, folder: str | Path, threads: int | None = None
    ) -> EmbeddingEngine:
        """Load a sentence-transformers folder (float32, CPU, offline).

        :raises EmbeddingModelError: the folder's modules, model or tokenizer cannot be read.
        """
        import torch
        from transformers import AutoModel, AutoTokenizer

        pooling = read_pooling(folder)
        if threads:
            torch.set_num_threads(threads)
        try:
            model = AutoModel.from_pretrained(str(folder), local_files_only=True)
            tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except Exception as e:
            raise EmbeddingModelError(f"cannot load the embedding model {folder}: {e}") from e
        model.eval()
        return cls(reactor, model, tokenizer, pooling)

    # The engine contract (a node that generates nothing)

    @property
    def context_window(self) -> int:
        return self._max_length

    @property
    def n_layers(self) -> int:
        return 0

    @property
    def supports_logprobs(self) -> bool:
        return False

    @property
    def supports_constraints(self) -> bool:
        return False

    @property
    def embedding_dim(self) -> int:
        return self._dim

    def statistics(self) -> EngineStatistics:
        return EngineStatistics(prefilled_tokens=self._tokens)

    def submit(self, request: GenerationRequest, on_tokens: TokenSink) -> _Refused:
        return _Refused()

    def stage_forward(
        self, tokens: Sequence[int], start_layer: int, end_layer: int, hidden_in: bytes | None
    ) -> defer.Deferred[StageResult]:
        return defer.fail(StageForwardError("an embedding model runs no pipeline stages"))

    def start(self) -> None:
        self._pool.start()
        self._running = True

    def stop(self) -> defer.Deferred[None]:
        self._running = False
        self._pool.stop()
        return defer.succeed(None)

    # Embedding

    def embed(self, texts: Sequence[str]) -> defer.Deferred[Embedded]:
        """One vector per text (docs/protocol.md section 12.7), computed on the worker."""
        if not self._running:
            return defer.fail(EmbeddingError("the engine is stopped"))
        done = deferToThreadPool(self._reactor, self._pool, self._run, list(texts))
        return done.addCallback(self._counted)

    def _counted(self, embedded: Embedded) -> Embedded:
        self._tokens += embedded.tokens
        return embedded

    def _run(self, texts: list[str]) -> Embedded:
        """On the worker: tokenize, run, pool and normalize, ``BATCH`` texts at a time."""
        import numpy as np
        import torch

        vectors: list[Any] = []
        tokens = 0
        for start in range(0, len(texts), BATCH):
            batch = self._tokenizer(
                texts[start : start + BATCH],
                padding=True,
                truncation=True,
                max_length=self._max_length,
                return_tensors="pt",
            )
            mask = batch["attention_mask"]
            tokens += int(mask.sum())
            with torch.inference_mode():
                hidden = self._model(**batch).last_hidden_state.float()
            vectors.append(pooled(hidden, mask, self.pooling).numpy())
        out = np.concatenate(vectors) if vectors else np.zeros((0, self._dim), np.float32)
        return Embedded(out.astype("<f4").tobytes(), self._dim, tokens)


def pooled(hidden: Any, mask: Any, pooling: Pooling) -> Any:
    """One vector per row of ``hidden`` (batch, tokens, size) under ``mask`` (batch, tokens),
    as sentence-transformers pools and normalizes."""
    import torch

    if pooling.mode == "cls":
        out = hidden[:, 0]
    elif pooling.mode == "max":
        out = hidden.masked_fill(mask.unsqueeze(-1) == 0, -1e9).max(dim=1).values
    else:
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        out = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
    if pooling.normalize:
        out = torch.nn.functional.normalize(out, p=2, dim=1)
    return out


__all__ = [
    "BATCH",
    "EmbeddingEngine",
    "EmbeddingModelError",
    "Pooling",
    "is_embedding_folder",
    "pooled",
    "read_pooling",
]
