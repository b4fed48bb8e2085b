"""The head's HTTP front (docs/api.md): the front door (``gate``), the OpenAI request schema and
response bodies, one request's life (``exchange``), the Responses API, Anthropic's Messages API
(``messages``), Ollama's API (``ollama``), embeddings (``embeddings``), the error mapping
(``failures``), request classes, logprobs objects and the head's ``/metrics``.

May import ``sfnode.head.fleet``, ``sfnode.head.models``, ``sfnode.head.link`` (its errors),
``sfnode.decoding``, ``sfnode.generation``, ``sfnode.linkf`` and ``sfnode.runtime``.
"""
