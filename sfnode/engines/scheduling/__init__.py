"""The engine's pure side: the scheduler that plans each step, the plan itself, the step rates
it sizes steps with, the prefix cache's index and prompt-lookup drafts.

May import ``sfnode.generation``, ``sfnode.decoding`` and ``sfnode.linkf``; never torch, never a
thread or the reactor.
"""
