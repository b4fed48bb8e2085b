"""Reading models from disk: a GGUF file's header and tensor table read without trusting them,
every tensor read as stored by sfnode's names (``stored``), the model's files and tokenizer
(``loading``, and the model-files cache of a GGUF file), the chat template a model brings
(``templates``), and a model's weights gathered for the runner (``gather``; what it converted is
kept between starts by ``packed``).

May import ``sfnode.engines``, ``sfnode.engines.kernels`` and ``sfnode.engines.families``, and
nothing else of sfnode.
"""
