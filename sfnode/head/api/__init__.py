"""The head's HTTP front (docs/api.md): the front door (``gate``), the OpenAI request schema and
response bodies, one request's life (``exchange``), the Responses API, Anthropic's Messages API
(``messages``), Ollama's API (``ollama``), embeddings (``embeddings``), the error mapping
(``failures``), request classes, logprobs objects, the head's ``/metrics`` and the console's
routes (``console``).

May import ``sfnode.head.fleet``, ``sfnode.head.models``, ``sfnode.head.link`` (its errors),
``sfnode.head.console``, ``sfnode.decoding``, ``sfnode.generation``, ``sfnode.linkf`` and
``sfnode.runtime``.
"""
