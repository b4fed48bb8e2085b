"""Which nodes a fleet may place on, as the model registry rules (docs/protocol.md sections 8.5
and 12.5): each link is judged at every handshake by the model it names and the files it
offers; files the head lacks are fetched once per content hash (BLOB_FETCH and the transfer
messages) and installed in the registry; a node refused is logged once with the reason and
left out of placement while it stays connected.  A model whose last node left is dropped
after a grace (``--model-grace``), so that a rolling restart keeps it; nodes past the registry's
caps on models and bundle bytes are refused as any other.

The rule itself is :meth:`sfnode.head.models.registry.ModelRegistry.judge`; this module only
joins it to the links.  It must never place, queue or fail a generation, and never keep a
link's state beyond its verdict.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING, TypeVar

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from sfnode.head.link.machine import LinkError
from sfnode.head.models.registry import LoadedFiles, ModelRegistry, Verdict
from sfnode.linkf.model_files import short_hash
from sfnode.linkf.wire import FEATURE_MODEL_FILES

if TYPE_CHECKING:
    from sfnode.head.link import NodeLink

DEFAULT_MODEL_GRACE_S = 30.0
"""How long a head keeps serving a model (its name, tokenizer and metrics) after its last node
left, for a rolling restart (``twistd sfhead --model-grace``)."""

_log = Logger(namespace="sfnode.head.models")
_T = TypeVar("_T")
Run = Callable[[Callable[[], LoadedFiles]], "Deferred[LoadedFiles]"]
"""Runs the reading of a bundle (a worker thread in the head; at once in tests)."""


def run_here(work: Callable[[], _T]) -> Deferred[_T]:
    return defer.maybeDeferred(work)


def offered_files(link: NodeLink) -> bytes | None:
    """The content hash of the model files ``link``'s node offers (None: it offers none, or
    did not set feature bit 4)."""
    ack = link.hello_ack
    if ack is None or not ack.feature_flags & FEATURE_MODEL_FILES or ack.model_files is None:
        return None
    return ack.model_files.content_hash


def offered_size(link: NodeLink) -> int:
    """The bytes of the model files ``link``'s node offers (0: none)."""
    ack = link.hello_ack
    if ack is None or ack.model_files is None:
        return 0
    return ack.model_files.total_len


@dataclass(eq=False)
class ModelAdmission:
    """The verdict on each link; ``changed(link)`` is called when one changes after the
    handshake (its files arrived, or their fetch failed).  ``run`` reads a fetched bundle
    into a tokenizer (half a second for a large one: the head runs it on a worker thread)."""

    registry: ModelRegistry
    run: Run = run_here
    _: KW_ONLY
    clock: IReactorTime | None = None
    grace_s: float = DEFAULT_MODEL_GRACE_S
    """How long a model whose last node left is kept (``--model-grace``; without a clock,
    for ever)."""
    after_drop: Callable[[], object] = lambda: None
    """Called once a model was dropped (the head gives the freed memory back to the
    system: a tokenizer's native allocations stay in the C heap otherwise)."""
    _leaving: dict[str, IDelayedCall] = field(default_factory=dict, init=False)
    """The drop of each model whose last node left, due after the grace."""
    changed: Callable[[NodeLink], None] = field(default=lambda link: None, init=False)
    _admitted: dict[NodeLink, bool] = field(default_factory=dict, init=False)
    _refused: dict[NodeLink, str] = field(default_factory=dict, init=False)
    """The reason each refused link was last logged with (logged again only if it
    changes: a node that redials is not a new line every time)."""
    _fetching: dict[bytes, list[NodeLink]] = field(default_factory=dict, init=False)
    """Links waiting for the files of each hash being fetched (one fetch per hash)."""

    def admits(self, link: NodeLink) -> bool:
        """Whether placement may use ``link``'s node (a link not judged yet may: the fleet
        judges every link at its handshake)."""
        return self._admitted.get(link, True)

    def refusal(self, link: NodeLink) -> str | None:
        """Why ``link``'s node takes no requests (None: it is not refused)."""
        return None if self._admitted.get(link, True) else self._refused.get(link)

    def fetching(self) -> bool:
        """Whether some node's files are being fetched or read now."""
        return bool(self._fetching)

    def knows(self, model: str | None) -> bool:
        """Whether the head serves ``model`` (its requests wait for a node; never
        "no node serves it")."""
        return model is not None and self.registry.get(model) is not None

    def forget(self, link: NodeLink) -> None:
        """``link`` left the fleet; the model it named is dropped after the grace if no node
        that names it is left."""
        self._admitted.pop(link, None)
        self._refused.pop(link, None)
        for waiting in self._fetching.values():
            if link in waiting:
                waiting.remove(link)
        name = link.models[0] if link.models else None
        if name is None or self.clock is None or name in self._leaving:
            return
        if any(other.models[:1] == (name,) for other in self._admitted):
            return
        self._leaving[name] = self.clock.callLater(self.grace_s, self._drop, name)

    def _drop(self, name: str) -> None:
        del self._leaving[name]
        if self.registry.drop(name):
            _log.info(
                "no longer serving {model}: its last node left {grace:g} s ago",
                model=name,
                grace=self.grace_s,
            )
            self.after_drop()

    def stop(self) -> None:
        """Cancel the drops due (the fleet stops)."""
        for call in self._leaving.values():
            if call.active():
                call.cancel()
        self._leaving.clear()

    def judge(self, link: NodeLink) -> bool:
        """Judge ``link`` (at its handshake); True when placement may use it now."""
        if not link.models:
            self._admitted[link] = True
            return True
        name = link.models[0]
        leaving = self._leaving.pop(name, None)
        if leaving is not None and leaving.active():
            leaving.cancel()  # a node of the model is back within the grace
        content_hash = offered_files(link)
        verdict = self.registry.judge(name, content_hash, offered_size(link))
        if verdict.fetch is not None:
            self._admitted[link] = False
            self._fetch(link, name, verdict.fetch)
            return False
        self._settle(link, name, verdict)
        return verdict.admit

    def _settle(self, link: NodeLink, name: str, verdict: Verdict) -> None:
        self._admitted[link] = verdict.admit
        if verdict.admit:
            if self._refused.pop(link, None) is not None:
                _log.info("node {node} serves {model} again", node=link.name, model=name)
            return
        if self._refused.get(link) != verdict.reason:
            self._refused[link] = verdict.reason
            _log.error(
                "refused node {node} for model {model}: {reason}; it stays connected but "
                "takes no requests",
                node=link.name,
                model=name,
                reason=verdict.reason,
            )

    def _fetch(self, link: NodeLink, name: str, content_hash: bytes) -> None:
        waiting = self._fetching.get(content_hash)
        if waiting is not None:
            if link not in waiting:
                waiting.append(link)
            return
        self._fetching[content_hash] = [link]
        _log.info(
            "fetching the model files of {model} ({hash}) from node {node}",
            model=name,
            hash=short_hash(content_hash),
            node=link.name,
        )
        fetched: Deferred[bytes] = link.files.start(content_hash, link.send_now)
        fetched.addCallbacks(
            self._fetched,
            self._fetch_failed,
            callbackArgs=(link, name, content_hash),
            errbackArgs=(link, name, content_hash),
        )

    def _fetched(self, data: bytes, link: NodeLink, name: str, content_hash: bytes) -> None:
        read = self.run(lambda: self.registry.read(data))
        read.addCallbacks(
            self._read,
            self._read_failed,
            callbackArgs=(data, link, content_hash),
            errbackArgs=(name, content_hash),
        ).addErrback(lambda failure: _log.failure("judging {node} failed", failure, node=name))

    def _read(self, loaded: LoadedFiles, data: bytes, link: NodeLink, content_hash: bytes) -> None:
        full = self.registry.room_for(content_hash, loaded.size)
        if full is not None:
            # Another bundle was kept while this one was fetched: the cap is judged again.
            for each in self._fetching.pop(content_hash, []):
                self._settle(
                    each, link.models[0] if link.models else "", Verdict(False, reason=full)
                )
                self.changed(each)
            return
        self.registry.keep(content_hash, loaded)
        _log.info(
            "installed the model files {hash} ({size} bytes) from node {node}",
            hash=short_hash(content_hash),
            size=len(data),
            node=link.name,
        )
        for waiting in self._fetching.pop(content_hash, []):
            if waiting.connected:
                self.judge(waiting)
                self.changed(waiting)

    def _fetch_failed(
        self, failure: Failure, link: NodeLink, name: str, content_hash: bytes
    ) -> None:
        """The transfer from ``link`` failed: a lost link is fetched from again when it comes
        back, a node that sent other files than it offered is refused; either way the
        next node waiting for the same files is asked instead."""
        waiting = [w for w in self._fetching.pop(content_hash, []) if w is not link]
        if isinstance(failure.value, LinkError):
            _log.info(
                "the transfer of the model files {hash} from node {node} was cut off: {error}",
                hash=short_hash(content_hash),
                node=link.name,
                error=failure.getErrorMessage(),
            )
        else:
            reason = f"its model files ({short_hash(content_hash)}) could not be read: "
            self._settle(link, name, Verdict(False, reason=reason + failure.getErrorMessage()))
            self.changed(link)
        others = [w for w in waiting if w.connected and w.models]
        if others:
            self._fetch(others[0], others[0].models[0], content_hash)
            self._fetching[content_hash].extend(others[1:])

    def _read_failed(self, failure: Failure, name: str, content_hash: bytes) -> None:
        """Files with the hash asked for make no tokenizer: every node offering them is
        refused."""
        reason = f"its model files ({short_hash(content_hash)}) could not be read: "
        reason += failure.getErrorMessage()
        for each in self._fetching.pop(content_hash, []):
            self._settle(each, name, Verdict(False, reason=reason))
            self.changed(each)


__all__ = [
    "DEFAULT_MODEL_GRACE_S",
    "ModelAdmission",
    "Run",
    "offered_files",
    "offered_size",
    "run_here",
]
