"""The models a head serves: the registry by name, each model's tokenizer and chat template
(rendering, detokenizing, stop strings) and the tool calls written into and read out of text.

May import ``sfnode.decoding``, ``sfnode.linkf`` and ``sfnode.runtime``; never torch.
"""
