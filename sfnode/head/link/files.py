"""The transfer of a node's model files to its head, on one link (docs/protocol.md section
12.5): BLOB_FETCH out, the node's XFER_BEGIN, XFER_CHUNKs and XFER_END (or XFER_ABORT) in, each
checked by :class:`~sfnode.linkf.model_files.Reassembly`.

:class:`FilesFetch` keeps the one fetch a link may have in progress.  It must never decide
what the files mean (the model registry does) and never close the link: a bad transfer fails
that fetch only.
"""

from __future__ import annotations

from collections.abc import Callable

from twisted.internet import defer
from twisted.internet.defer import Deferred

from sfnode.head.link.machine import LinkError
from sfnode.linkf.model_files import ModelFilesError, Reassembly
from sfnode.linkf.wire import (
    BlobFetchMsg,
    Message,
    XferAbortMsg,
    XferBeginMsg,
    XferChunkMsg,
    XferEndMsg,
)

TransferMsg = XferBeginMsg | XferChunkMsg | XferEndMsg | XferAbortMsg


class FilesFetch:
    """The fetch of model files in progress on one link (at most one)."""

    def __init__(self) -> None:
        self._current: tuple[Reassembly, Deferred[bytes]] | None = None

    def start(self, content_hash: bytes, send: Callable[[Message], bool]) -> Deferred[bytes]:
        """Ask for the files named ``content_hash`` through ``send`` (the link's
        ``send_now``); fires with the bundle, checked against the hash, or fails with
        :class:`~sfnode.linkf.model_files.ModelFilesError` (the node sent something else, or
        aborted) or :class:`LinkError` (no connection, or it was lost first)."""
        if self._current is not None:
            return defer.fail(ModelFilesError("a transfer of model files is in progress"))
        if not send(BlobFetchMsg(content_hash)):
            return defer.fail(LinkError("the link is not open"))
        done: Deferred[bytes] = Deferred()
        self._current = (Reassembly(content_hash), done)
        return done

    def receive(self, message: TransferMsg) -> None:
        """One transfer message from the node (ignored when nothing was asked, as section
        4.1 says of these types)."""
        if self._current is None:
            return
        reassembly, done = self._current
        try:
            if isinstance(message, XferBeginMsg):
                reassembly.begin(message)
            elif isinstance(message, XferChunkMsg):
                reassembly.chunk(message)
            elif isinstance(message, XferEndMsg):
                data = reassembly.end(message)
                self._current = None
                done.callback(data)
            else:
                raise ModelFilesError(f"the node aborted the transfer (reason {message.reason})")
        except ModelFilesError as e:
            self.fail(e)

    def fail(self, error: Exception) -> None:
        """Fail the fetch in progress, if any (the link was lost, or the transfer is bad)."""
        if self._current is not None:
            _, done = self._current
            self._current = None
            done.errback(error)


__all__ = ["FilesFetch", "TransferMsg"]
