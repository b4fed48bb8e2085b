"""The ``twistd sfnode`` plugin: a Link F node agent.

This file is read by Twisted's plugin scanner on every ``twistd`` start, so it must stay a few
lines that import nothing of sfnode: ``ServiceMaker`` imports :mod:`sfnode.node.tap` only when the
``sfnode`` subcommand is chosen, and torch only when the transformers engine is built.  There is
deliberately no ``__init__.py`` in ``twisted/`` or ``twisted/plugins/``.
"""

from twisted.application.service import ServiceMaker

sfnode = ServiceMaker(
    "sfnode",
    "sfnode.node.tap",
    "A Link F node agent: runs generations for a fleet head (dials it or accepts it).",
    "sfnode",
)
