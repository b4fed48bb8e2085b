"""The models a head serves, keyed by model name: each one's renderer (tokenizer and chat
template), vocabulary bound and where its files came from, and the rule that decides whether a
node that names a model may serve it (docs/protocol.md sections 8.5 and 12.5).

A model gets into the registry three ways:

- ``--model`` (an *override*): the head's own files for that name; whatever a node sends for
  that name is not fetched, and every node that names it serves it;
- the bundled model's tokenizer, when the head was started without ``--model`` and has it
  installed (*provisional*): it serves ``--model-name`` for nodes that send no files (older
  nodes, the mock engine) until a node sends files for that name, which then replace it;
- the files a node sends (feature bit 4, section 12.5): the first node that names a model and
  brings files binds that name to their content hash; a later node that names it with other
  files is refused (it stays connected, never placed on), because one name must mean one
  tokenizer for every node that answers it.

Files are kept once per content hash: two names with the same files share one tokenizer.  A
model served with nodes' files is dropped (:meth:`ModelRegistry.drop`, its bundle with it when
no other name uses it) once its last node has left, and the models and bundle bytes that nodes'
files bring are capped (``max_models``, ``max_bytes``): a node past a cap is refused, with the
reason, as any other refused node.

This module is pure: it must never do I/O, touch the reactor or a link, or import torch or
transformers (a tokenizer is built from bytes by the ``load`` function it is given).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from sfnode.head.models.text import Renderer
from sfnode.linkf.model_files import ModelFilesError, short_hash, unpack_bundle

DEFAULT_MAX_NODE_MODELS = 32
"""The most models a head serves with nodes' files (``twistd sfhead --max-node-models``)."""
DEFAULT_MAX_MODEL_BYTES = 256 * 1024 * 1024
"""The most bytes of nodes' model bundles a head keeps (``--max-model-bytes``); a tokenizer
read from them takes several times their size in memory."""

TokenizerFromFiles = Callable[[Mapping[str, bytes]], Any]
"""Builds a tokenizer (what :class:`~sfnode.head.models.text.Renderer` takes) from a bundle's
files."""


def tokenizer_from_files(files: Mapping[str, bytes]) -> Any:
    """A :class:`~sfnode.head.models.text.HeadTokenizer` read from ``files`` (no folder, no
    torch)."""
    from sfnode.head.models.text import HeadTokenizer

    return HeadTokenizer.from_files(files)


def vocab_size_of(files: Mapping[str, bytes]) -> int | None:
    """``vocab_size`` of the bundle's config.json, when it has one (it may exceed the
    tokenizer's: embedding tables are often padded)."""
    try:
        config = json.loads(files.get("config.json", b"{}"))
    except ValueError:
        return None
    size = config.get("vocab_size") if isinstance(config, dict) else None
    return size if isinstance(size, int) and size > 0 else None


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One model the head serves."""

    name: str
    renderer: Renderer
    vocab_size: int
    """Prompt token ids must be below this."""
    origin: str
    """Where its files came from, for log lines: ``--model PATH``, ``the bundled tokenizer``,
    ``files of node N``."""
    content_hash: bytes | None = None
    """The content hash of the node files it is served with (None: the head's own files)."""
    override: bool = False
    """``--model``: nodes' files for this name are never fetched nor compared."""
    provisional: bool = False
    """The bundled tokenizer, served until a node sends files for this name."""


@dataclass(frozen=True, slots=True)
class LoadedFiles:
    """A bundle read into a tokenizer, not yet kept by the registry."""

    tokenizer: Any
    vocab_size: int | None
    size: int = 0
    """The bundle's bytes (what :attr:`ModelRegistry.max_bytes` counts)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the head does with a node that names a model: place on it (``admit``), fetch its
    files first (``fetch``, then judge again), or leave it out (``reason`` says why)."""

    admit: bool
    fetch: bytes | None = None
    reason: str = ""


ADMIT = Verdict(True)


@dataclass(eq=False)
class ModelRegistry:
    """The head's models by name, and one tokenizer per distinct bundle of files."""

    _: KW_ONLY
    allow_special_tokens: bool = False
    load: TokenizerFromFiles = tokenizer_from_files
    max_models: int = DEFAULT_MAX_NODE_MODELS
    """The most models served with nodes' files (``--max-node-models``)."""
    max_bytes: int = DEFAULT_MAX_MODEL_BYTES
    """The most bytes of nodes' bundles kept (``--max-model-bytes``)."""
    _models: dict[str, ServedModel] = field(default_factory=dict, init=False)
    _by_hash: dict[bytes, tuple[Any, int | None, int]] = field(default_factory=dict, init=False)
    """Tokenizer, config vocab size and bytes of each bundle installed (one copy per
    hash)."""

    def serve(
        self,
        name: str,
        tokenizer: Any,
        *,
        origin: str,
        vocab_size: int | None = None,
        content_hash: bytes | None = None,
        override: bool = False,
        provisional: bool = False,
    ) -> ServedModel:
        """Serve ``name`` with ``tokenizer`` (replacing what served it)."""
        renderer = Renderer(tokenizer, allow_special_tokens=self.allow_special_tokens)
        model = ServedModel(
            name=name,
            renderer=renderer,
            vocab_size=max(vocab_size or 0, renderer.codec.vocab_size),
            origin=origin,
            content_hash=content_hash,
            override=override,
            provisional=provisional,
        )
        self._models[name] = model
        return model

    def get(self, name: str) -> ServedModel | None:
        return self._models.get(name)

    def names(self) -> tuple[str, ...]:
        """The names served, in the order they were first served."""
        return tuple(self._models)

    def __len__(self) -> int:
        return len(self._models)

    def judge(self, name: str, content_hash: bytes | None, size: int = 0) -> Verdict:
        """Whether a node that names ``name`` and offers the files ``content_hash`` (None: it
        offers none) of ``size`` bytes may serve it now; a bundle installed before under
        another name is served at once, without a fetch; a name or a bundle past the caps
        (:attr:`max_models`, :attr:`max_bytes`) is refused."""
        model = self._models.get(name)
        if model is not None and model.override:
            return ADMIT
        if content_hash is None:
            if model is not None:
                return ADMIT
            return Verdict(
                False,
                reason=f"it sends no model files for {name} (docs/protocol.md section 12.5) and "
                "this head has no --model for it",
            )
        if model is not None and model.content_hash == content_hash:
            return ADMIT
        if model is not None and not model.provisional:
            return Verdict(
                False,
                reason=f"its files for {name} ({short_hash(content_hash)}) differ from those "
                f"this head serves {name} with ({short_hash(model.content_hash or b'')}, "
                f"{model.origin})",
            )
        full = self._over_caps(name, content_hash, size)
        if full is not None:
            return full
        installed = self._by_hash.get(content_hash)
        if installed is None:
            return Verdict(False, fetch=content_hash)
        tokenizer, vocab_size, _ = installed
        self.serve(
            name,
            tokenizer,
            origin=f"files {short_hash(content_hash)}",
            vocab_size=vocab_size,
            content_hash=content_hash,
        )
        return ADMIT

    def install(self, content_hash: bytes, data: bytes) -> None:
        """Keep the bundle ``data`` (checked to have ``content_hash`` by the transfer) as a
        tokenizer; :meth:`judge` then serves it to any name that offers it.

        :raises ModelFilesError: the files cannot be read, or do not make a tokenizer.
        """
        if content_hash not in self._by_hash:
            self.keep(content_hash, self.read(data))

    def _over_caps(self, name: str, content_hash: bytes, size: int) -> Verdict | None:
        """The refusal of a new name or bundle that would pass a cap (None: within them)."""
        served = self._models.get(name)
        if (served is None or served.content_hash is None) and self.node_models >= self.max_models:
            return Verdict(
                False,
                reason=f"this head serves {self.node_models} models from nodes' files, its "
                f"limit (--max-node-models {self.max_models}): {name} is not served",
            )
        full = self.room_for(content_hash, size)
        return None if full is None else Verdict(False, reason=full)

    def room_for(self, content_hash: bytes, size: int) -> str | None:
        """Why a bundle of ``size`` bytes cannot be kept now (None: it can)."""
        if content_hash in self._by_hash or self.bundle_bytes + size <= self.max_bytes:
            return None
        return (
            f"its model files ({size} bytes) would pass the bytes of model files this head "
            f"keeps ({self.bundle_bytes} of --max-model-bytes {self.max_bytes})"
        )

    def drop(self, name: str) -> bool:
        """Stop serving ``name`` when nodes' files serve it (the head's own files and the
        bundled tokenizer stay), and forget its bundle when no other name uses it; True when
        it was dropped."""
        model = self._models.get(name)
        if model is None or model.content_hash is None or model.override or model.provisional:
            return False
        del self._models[name]
        if all(m.content_hash != model.content_hash for m in self._models.values()):
            self._by_hash.pop(model.content_hash, None)
        return True

    @property
    def node_models(self) -> int:
        """Models served with nodes' files."""
        return sum(1 for m in self._models.values() if m.content_hash is not None)

    @property
    def bundle_bytes(self) -> int:
        """Bytes of the nodes' bundles kept."""
        return sum(size for _, _, size in self._by_hash.values())

    def read(self, data: bytes) -> LoadedFiles:
        """The tokenizer (and config vocabulary size) of the bundle ``data``: the slow half of
        :meth:`install` (half a second for a large tokenizer), which touches nothing of the
        registry, so it may run on a worker thread.

        :raises ModelFilesError: the files cannot be read, or do not make a tokenizer.
        """
        files = unpack_bundle(data)
        try:
            tokenizer = self.load(files)
        except Exception as e:
            raise ModelFilesError(f"the model files do not make a tokenizer: {e}") from e
        return LoadedFiles(tokenizer, vocab_size_of(files), len(data))

    def keep(self, content_hash: bytes, loaded: LoadedFiles) -> None:
        """Keep what :meth:`read` made of the bundle ``content_hash`` (the first copy wins)."""
        self._by_hash.setdefault(content_hash, (loaded.tokenizer, loaded.vocab_size, loaded.size))

    @property
    def bundles(self) -> int:
        """Distinct bundles of node files kept."""
        return len(self._by_hash)


__all__ = [
    "ADMIT",
    "DEFAULT_MAX_MODEL_BYTES",
    "DEFAULT_MAX_NODE_MODELS",
    "LoadedFiles",
    "ModelRegistry",
    "ServedModel",
    "TokenizerFromFiles",
    "Verdict",
    "tokenizer_from_files",
    "vocab_size_of",
]
