"""How the next token is chosen, as pure pieces both sides share: the counter-based draws,
the exact sampler and the constraints (grammars, tool-call markers, penalties, logit bias).

May import ``sfnode.linkf`` and ``sfnode.generation`` only.  The head compiles and checks grammars
with it too, so nothing here imports torch at module level or touches the reactor.
"""
