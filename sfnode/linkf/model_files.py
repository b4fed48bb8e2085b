"""Model files from node to head (docs/protocol.md section 12.5, D21-D22): the bundle, its
content hash, the chunks a node sends and the head's checked reassembly.

A node that serves a model sends its head what the head's text layer reads to serve it (the
tokenizer, the chat template, special tokens, EOS ids, the vocabulary size): the files of
:data:`MODEL_FILE_NAMES` that its model folder holds, as one **bundle** = the msgpack array of
``[name, bytes]`` pairs sorted by name (the encoding rules of section 3).  The bundle's
**content hash** is its SHA-256; it names the bundle on the wire (HELLO_ACK_F's ``model_files``,
BLOB_FETCH, XFER_BEGIN) and lets a head keep one copy per distinct bundle and tell two nodes
that name one model but bring different files apart.

:class:`Reassembly` is the head's side of one transfer: it takes XFER_BEGIN, XFER_CHUNKs in
order and XFER_END, and either yields the bundle whose hash was asked for or fails with a
:class:`ModelFilesError` naming what was wrong.

This module is pure: it must never do I/O beyond :func:`read_bundle` (which only reads the named
files of one folder), never import torch or transformers, and never trust a length, offset or
name it was sent.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import msgpack

from sfnode.linkf.wire import (
    PayloadError,
    XferBeginMsg,
    XferChunkMsg,
    XferEndMsg,
    unpack,
)

MODEL_FILE_NAMES = (
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
)
"""The files a bundle may hold, and the only names a head accepts in one."""
CONTENT_TYPE_MODEL_FILES = 1
"""XFER_BEGIN's ``content_type`` of a bundle of model files."""
MAX_BUNDLE_BYTES = 1 << 26
"""The largest bundle (64 MiB): ``LinkFLimits.max_transfer``, the transfer bound a node
advertises (section 2.3)."""
CHUNK_BYTES = 1 << 20
"""The data of one XFER_CHUNK (1 MiB): far below the frame's limit, so other frames of the link
(token events, keepalives) are never held behind one chunk for long."""
XFER_ABORT_UNKNOWN = 1
"""XFER_ABORT's reason when the node holds no bundle with the hash asked for."""


class ModelFilesError(Exception):
    """A bundle or a transfer is not what it must be; the message says what."""


@dataclass(frozen=True, slots=True)
class Bundle:
    """A node's model files, encoded, with their content hash."""

    data: bytes
    content_hash: bytes

    @property
    def checksum(self) -> int:
        """XFER_BEGIN's ``checksum``: the hash's first 8 bytes, big-endian."""
        return int.from_bytes(self.content_hash[:8], "big")

    @property
    def short_hash(self) -> str:
        return short_hash(self.content_hash)


def short_hash(content_hash: bytes) -> str:
    """The first 12 hex digits of a content hash, for log lines."""
    return content_hash.hex()[:12]


def make_bundle(files: Mapping[str, bytes]) -> Bundle:
    """The bundle of ``files`` (names of :data:`MODEL_FILE_NAMES` only).

    :raises ModelFilesError: an unknown name, or a bundle above :data:`MAX_BUNDLE_BYTES`.
    """
    unknown = sorted(set(files) - set(MODEL_FILE_NAMES))
    if unknown:
        raise ModelFilesError(f"not a model file a head reads: {', '.join(unknown)}")
    pairs = [[name, bytes(files[name])] for name in sorted(files)]
    data: bytes = msgpack.packb(pairs, use_bin_type=True)
    if len(data) > MAX_BUNDLE_BYTES:
        raise ModelFilesError(
            f"the model files take {len(data)} bytes, more than the {MAX_BUNDLE_BYTES} a "
            "transfer may carry"
        )
    return Bundle(data, hashlib.sha256(data).digest())


def read_bundle(folder: str | Path) -> Bundle | None:
    """The bundle of the model files in ``folder``; None when it holds no ``tokenizer.json``
    (nothing a head could serve with).

    :raises ModelFilesError: a file cannot be read, or the bundle is too large.
    """
    path = Path(folder)
    if not (path / "tokenizer.json").is_file():
        return None
    files = {}
    for name in MODEL_FILE_NAMES:
        file = path / name
        if file.is_file():
            try:
                files[name] = file.read_bytes()
            except OSError as e:
                raise ModelFilesError(f"cannot read {file}: {e}") from e
    return make_bundle(files)


def unpack_bundle(data: bytes) -> dict[str, bytes]:
    """The files of a bundle, checked: an array of ``[name, bytes]`` pairs, names among
    :data:`MODEL_FILE_NAMES`, each once, and a ``tokenizer.json``.

    :raises ModelFilesError: anything else.
    """
    try:
        obj = unpack(data)
    except PayloadError as e:
        raise ModelFilesError(f"the model files do not decode: {e}") from e
    if type(obj) is not list:
        raise ModelFilesError("the model files are not an array of [name, bytes] pairs")
    files: dict[str, bytes] = {}
    for pair in obj:
        if (
            type(pair) is not list
            or len(pair) != 2
            or type(pair[0]) is not str
            or type(pair[1]) is not bytes
        ):
            raise ModelFilesError("the model files are not an array of [name, bytes] pairs")
        name, content = pair
        if name not in MODEL_FILE_NAMES:
            raise ModelFilesError(f"{name[:64]!r} is not a model file a head reads")
        if name in files:
            raise ModelFilesError(f"{name} appears twice in the model files")
        files[name] = content
    if "tokenizer.json" not in files:
        raise ModelFilesError("the model files hold no tokenizer.json")
    return files


def transfer_messages(
    bundle: Bundle, transfer_id: int
) -> Iterator[XferBeginMsg | XferChunkMsg | XferEndMsg]:
    """What a node sends for one BLOB_FETCH of ``bundle``: XFER_BEGIN, the chunks in order,
    XFER_END."""
    yield XferBeginMsg(
        transfer_id=transfer_id,
        total_len=len(bundle.data),
        checksum=bundle.checksum,
        content_type=CONTENT_TYPE_MODEL_FILES,
        content_hash=bundle.content_hash,
    )
    for offset in range(0, len(bundle.data), CHUNK_BYTES):
        yield XferChunkMsg(transfer_id, offset, bundle.data[offset : offset + CHUNK_BYTES])
    yield XferEndMsg(transfer_id)


class Reassembly:
    """The head's side of one transfer of the bundle named ``content_hash``.

    Feed it the node's XFER messages; :meth:`end` returns the checked bundle.  Every method
    raises :class:`ModelFilesError` on anything a correct node would not send.
    """

    def __init__(self, content_hash: bytes) -> None:
        self.content_hash = content_hash
        self.transfer_id: int | None = None
        self.total_len = 0
        self._parts: list[bytes] = []
        self._received = 0

    def begin(self, msg: XferBeginMsg) -> None:
        if self.transfer_id is not None:
            raise ModelFilesError("a second XFER_BEGIN for one transfer")
        if msg.content_type != CONTENT_TYPE_MODEL_FILES:
            raise ModelFilesError(f"content type {msg.content_type} is not model files")
        if msg.content_hash != self.content_hash:
            raise ModelFilesError(
                f"the node sent files {short_hash(msg.content_hash)}, not the "
                f"{short_hash(self.content_hash)} asked for"
            )
        if msg.total_len > MAX_BUNDLE_BYTES:
            raise ModelFilesError(
                f"{msg.total_len} bytes of model files, more than {MAX_BUNDLE_BYTES}"
            )
        if msg.checksum != int.from_bytes(msg.content_hash[:8], "big"):
            raise ModelFilesError("XFER_BEGIN's checksum does not match its content hash")
        self.transfer_id = msg.transfer_id
        self.total_len = msg.total_len

    def chunk(self, msg: XferChunkMsg) -> None:
        self._check_id(msg.transfer_id, "XFER_CHUNK")
        if msg.offset != self._received:
            raise ModelFilesError(
                f"a chunk at offset {msg.offset} where {self._received} was expected"
            )
        if self._received + len(msg.data) > self.total_len:
            raise ModelFilesError(f"more than the {self.total_len} bytes XFER_BEGIN announced")
        self._parts.append(msg.data)
        self._received += len(msg.data)

    def end(self, msg: XferEndMsg) -> bytes:
        self._check_id(msg.transfer_id, "XFER_END")
        if self._received != self.total_len:
            raise ModelFilesError(
                f"the transfer ended after {self._received} of {self.total_len} bytes"
            )
        data = b"".join(self._parts)
        self._parts = []
        if hashlib.sha256(data).digest() != self.content_hash:
            raise ModelFilesError("the files received do not have the content hash announced")
        return data

    def _check_id(self, transfer_id: int, what: str) -> None:
        if self.transfer_id is None:
            raise ModelFilesError(f"{what} before XFER_BEGIN")
        if transfer_id != self.transfer_id:
            raise ModelFilesError(f"{what} of transfer {transfer_id}, not {self.transfer_id}")


__all__ = [
    "CHUNK_BYTES",
    "CONTENT_TYPE_MODEL_FILES",
    "MAX_BUNDLE_BYTES",
    "MODEL_FILE_NAMES",
    "XFER_ABORT_UNKNOWN",
    "Bundle",
    "ModelFilesError",
    "Reassembly",
    "make_bundle",
    "read_bundle",
    "short_hash",
    "transfer_messages",
    "unpack_bundle",
]
