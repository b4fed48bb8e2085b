"""Reading models from disk: a GGUF file's tensor table read without trusting it, loading a
transformers folder or a GGUF file (and the conversion cache), and a Llama model's weights gathered
for the runner.

May import ``sfnode.engines.kernels`` and nothing else of sfnode.
"""
