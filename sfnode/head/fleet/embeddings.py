"""Embedding requests on the fleet (docs/protocol.md section 12.7): texts placed only on a live
node that serves the model as an embedding model (``FEATURE_EMBEDDINGS``), the one with the
fewest of this head's embeddings outstanding, and asked again on another such node when the
link is lost or the node refuses (at most :data:`ATTEMPTS` nodes).

An embedding is a pure function of its texts: it needs no session, no queue and no failover
state, so this is the whole of it.  This module must never place a generation, read a clock,
or hand a caller vectors of the wrong length.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from twisted.internet import defer
from twisted.internet.defer import Deferred

from sfnode.generation import Embedded
from sfnode.head.fleet.backend import NoNodeAvailable
from sfnode.head.fleet.nodes import FleetNode
from sfnode.head.link import LinkError, embed

ATTEMPTS = 3
"""Nodes one embedding is asked of at most."""


class Embeddings:
    """The fleet's embeddings: :meth:`embed` places texts on embedding nodes."""

    def __init__(self, nodes: Callable[[], Sequence[FleetNode]]) -> None:
        self._nodes = nodes
        self._outstanding: Counter[str] = Counter()

    def serving(self, model: str) -> list[FleetNode]:
        """The live nodes that serve ``model`` as an embedding model."""
        return [n for n in self._nodes() if n.live and n.embeds and model in n.models]

    def embed(self, model: str, texts: Sequence[str]) -> Deferred[Embedded]:
        """One vector per text from a node serving ``model``; fails with
        :class:`~sfnode.head.fleet.backend.NoNodeAvailable` when none is live or every one
        asked lost the link or refused."""
        return defer.ensureDeferred(self._embed(model, tuple(texts)))

    async def _embed(self, model: str, texts: tuple[str, ...]) -> Embedded:
        tried: list[FleetNode] = []
        why = f"no live node serves {model} as an embedding model"
        for _ in range(ATTEMPTS):
            candidates = [n for n in self.serving(model) if n not in tried]
            if not candidates:
                break
            node = min(candidates, key=lambda n: (self._outstanding[n.name], n.order))
            tried.append(node)
            self._outstanding[node.name] += 1
            try:
                answer = await embed(node.link, texts)
            except LinkError as e:
                why = f"the link to {node.name} was lost during an embedding: {e}"
                continue
            finally:
                self._outstanding[node.name] -= 1
                if not self._outstanding[node.name]:
                    del self._outstanding[node.name]
            vectors = answer.vectors
            if vectors is None or answer.dim == 0 or len(vectors) != len(texts) * answer.dim * 4:
                why = f"{node.name} refused the embedding"
                continue
            return Embedded(vectors, answer.dim, answer.tokens)
        raise NoNodeAvailable(why)


__all__ = ["ATTEMPTS", "Embeddings"]
