"""Grammars compiled on the head: off the reactor, within a time limit, once per grammar.

A request's ``response_format`` or ``tools`` becomes a grammar (:mod:`sfnode.head.api.schema`),
and the head asks the grammar library whether it can enforce it before any node is asked
(docs/api.md "Structured output").  Compiling costs what the schema asks: a few hundred
``patternProperties`` take seconds of native code.  :class:`GrammarChecks` compiles each distinct
grammar once, on the HTTP layer's workers in the requesting client's turn
(:mod:`sfnode.head.api.workers`), and keeps the verdict, keyed by the grammar's text (the JSON
Schema or the tools, as the wire carries them): the same schema again is answered at once,
and a request whose grammar is being compiled waits for that one compile.  A compile that
takes longer than ``timeout_s`` is refused with a 400 ``grammar_timeout`` naming the limit
(``--grammar-timeout``), a verdict kept as any other; its thread runs on, counted against its
client.

This module must never compile on the reactor's thread, keep more than :data:`MAX_VERDICTS`
verdicts, or let a grammar the library refused reach a node.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.python.failure import Failure

from sfnode.decoding.constraint import ConstraintError, check_grammar
from sfnode.head.api.exchange import Runner
from sfnode.linkf.wire import Grammar, ToolsGrammar
from sfnode.runtime.http_guard import HttpError, clip

DEFAULT_GRAMMAR_TIMEOUT_S = 2.0
"""How long compiling one request's grammar may take (``twistd sfhead --grammar-timeout``)."""
MAX_VERDICTS = 1024
"""Grammars whose verdict is kept (the least recently used go first)."""

Verdict = tuple[str, str | None] | None
"""None: the library can enforce the grammar; else (message, code) of the 400 that refuses it."""


def param_of(grammar: Grammar) -> str:
    """The request field a grammar comes from (what its refusal names)."""
    return "tools" if isinstance(grammar, ToolsGrammar) else "response_format"


def _compile(grammar: Grammar) -> Verdict:
    """The library's verdict on ``grammar`` (on a worker thread)."""
    try:
        check_grammar(grammar, param_of(grammar))
    except ConstraintError as e:
        return clip(e.message, 300), None
    return None


class GrammarChecks:
    """Each grammar's verdict, compiled once (see the module)."""

    def __init__(self, workers: Runner, timeout_s: float = DEFAULT_GRAMMAR_TIMEOUT_S) -> None:
        self._workers = workers
        self.timeout_s = timeout_s
        self._verdicts: OrderedDict[Grammar, Verdict] = OrderedDict()
        self._compiling: dict[Grammar, list[Deferred[None]]] = {}
        self.compiles = 0
        """Grammars handed to the library (a cached verdict is no compile)."""

    def check(self, grammar: Grammar, client: Hashable = "") -> Deferred[None]:
        """Fires when the library can enforce ``grammar``; fails with the 400 that refuses it
        (its own reason, or ``grammar_timeout``)."""
        if grammar in self._verdicts:
            self._verdicts.move_to_end(grammar)
            return self._answer(grammar, self._verdicts[grammar])
        waiter: Deferred[None] = Deferred()
        waiting = self._compiling.get(grammar)
        if waiting is not None:
            waiting.append(waiter)
            return waiter
        self._compiling[grammar] = [waiter]
        self.compiles += 1
        compiled = self._workers.run(
            lambda: _compile(grammar),
            client,
            budget_s=self.timeout_s,
            refusal=lambda: self._timed_out(grammar),
        )
        compiled.addCallback(self._decided, grammar).addErrback(self._failed, grammar)
        return waiter

    def _timed_out(self, grammar: Grammar) -> HttpError:
        return HttpError(
            400,
            f"{param_of(grammar)} asks for a grammar that did not compile within "
            f"{self.timeout_s:g} s (--grammar-timeout, the limit of a request on this server)",
            param=param_of(grammar),
            code="grammar_timeout",
        )

    def _decided(self, verdict: Verdict, grammar: Grammar) -> None:
        self._keep(grammar, verdict)
        for waiter in self._compiling.pop(grammar, []):
            self._answer(grammar, verdict).chainDeferred(waiter)

    def _failed(self, failure: Failure, grammar: Grammar) -> None:
        error = failure.value
        if isinstance(error, HttpError) and error.code == "grammar_timeout":
            self._keep(grammar, (error.message, error.code))
        for waiter in self._compiling.pop(grammar, []):
            waiter.errback(failure)

    def _keep(self, grammar: Grammar, verdict: Verdict) -> None:
        self._verdicts[grammar] = verdict
        while len(self._verdicts) > MAX_VERDICTS:
            self._verdicts.popitem(last=False)

    def _answer(self, grammar: Grammar, verdict: Verdict) -> Deferred[None]:
        if verdict is None:
            return defer.succeed(None)
        message, code = verdict
        return defer.fail(HttpError(400, message, param=param_of(grammar), code=code))


__all__ = ["DEFAULT_GRAMMAR_TIMEOUT_S", "MAX_VERDICTS", "GrammarChecks", "param_of"]
