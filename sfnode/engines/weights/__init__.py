"""Reading models from disk: a GGUF file's header and tensor table read without trusting them,
every tensor read as stored by sfnode's names (``stored``), loading a
transformers folder or a GGUF file (and the conversion cache), and a Llama model's weights gathered
for the runner.

May import ``sfnode.engines``, ``sfnode.engines.kernels`` and ``sfnode.engines.families``, and
nothing else of sfnode.
"""
