"""How the next token is chosen, as pure pieces both sides share: the counter-based draws
(``draws``), the exact sampler over a model's dense logits (``sampler``, torch) and over sparse
logits (``sparse_sampler``, pure Python: the mock engine's), the constraints (grammars,
tool-call markers, penalties, logit bias) and the closing of a constrained output within its
budget (``closing``).

May import ``sfnode.linkf`` and ``sfnode.generation`` only.  The head compiles and checks grammars
with it too, so nothing here touches the reactor, and only ``sampler`` imports torch (the model
runners alone import it).
"""
