"""The ``twistd sfhead`` plugin: a Link F fleet head with an OpenAI-compatible HTTP API.

Read by Twisted's plugin scanner on every ``twistd`` start, so it stays a few lines that import
nothing of sfnode: ``ServiceMaker`` imports :mod:`sfnode.head.tap` only when ``sfhead`` is
chosen, and that never imports torch.  There is deliberately no ``__init__.py`` here.
"""

from twisted.application.service import ServiceMaker

sfhead = ServiceMaker(
    "sfhead",
    "sfnode.head.tap",
    "A Link F fleet head: places sessions on nodes and serves an OpenAI-compatible API.",
    "sfhead",
)
