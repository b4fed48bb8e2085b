"""The official client packages (``openai``, ``anthropic``) as the tests make them: no retries,
closed by the test's cleanup, and one TLS context for every client of the test process.

Each client otherwise builds its own TLS context, reading the CA bundle (about 30 ms a client,
and the suite makes dozens), although the tests only ever speak plain HTTP on loopback.  This
module only makes clients: it never sends a request.
"""

from __future__ import annotations

import functools
import ssl
from typing import Any

from twisted.trial.unittest import SynchronousTestCase


@functools.cache
def _tls() -> ssl.SSLContext:
    return ssl.create_default_context()


def openai_client(
    test: SynchronousTestCase, base_url: str, api_key: str = "unused", **options: Any
) -> Any:
    """An ``openai.OpenAI`` for ``base_url`` (``options`` as that class takes them), closed
    when ``test`` ends."""
    import openai

    client = openai.OpenAI(
        base_url=base_url,
        api_key=api_key,
        max_retries=0,
        http_client=openai.DefaultHttpxClient(verify=_tls()),
        **options,
    )
    test.addCleanup(client.close)
    return client


def anthropic_client(test: SynchronousTestCase, base_url: str, **options: Any) -> Any:
    """An ``anthropic.Anthropic`` for ``base_url`` (``options`` as that class takes them:
    ``api_key`` or ``auth_token``), closed when ``test`` ends."""
    import anthropic

    client = anthropic.Anthropic(
        base_url=base_url,
        max_retries=0,
        http_client=anthropic.DefaultHttpxClient(verify=_tls()),
        **options,
    )
    test.addCleanup(client.close)
    return client
