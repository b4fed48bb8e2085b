"""The OpenAI response bodies (sfnode.head.api.bodies): pure functions, no request, no reactor.

The shapes are those OpenAI's clients parse; the end-to-end tests (tests/test_http.py, with the
``openai`` package) show that they do, these pin each shape alone."""

from __future__ import annotations

import json

from twisted.trial.unittest import SynchronousTestCase

from sfnode.head.api import bodies
from sfnode.runtime.http_guard import HttpError

CHAT = bodies.Reply("chatcmpl-1", 1700000000, "m", chat=True)
TEXT = bodies.Reply("cmpl-1", 1700000000, "m", chat=False)


class ChunkTests(SynchronousTestCase):
    def test_chat_delta_role_and_finish(self) -> None:
        """A chat stream's chunks are ``chat.completion.chunk`` with a delta: the role chunk
        carries the assistant role and empty content, a text chunk the content and its
        logprobs, the finish chunk an empty delta and the finish reason."""
        role = bodies.role_chunk(CHAT, 1)
        self.assertEqual(role["object"], "chat.completion.chunk")
        self.assertEqual(
            role["choices"],
            [
                {
                    "index": 1,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        )
        piece = bodies.delta_chunk(CHAT, 0, "hi", logprobs={"content": []})
        self.assertEqual(
            piece["choices"],
            [
                {
                    "index": 0,
                    "delta": {"content": "hi"},
                    "logprobs": {"content": []},
                    "finish_reason": None,
                }
            ],
        )
        end = bodies.finish_chunk(CHAT, 0, "length")
        self.assertEqual(end["choices"][0]["delta"], {})
        self.assertEqual(end["choices"][0]["finish_reason"], "length")
        for chunk in (role, piece, end):
            self.assertEqual(
                (chunk["id"], chunk["created"], chunk["model"]), ("chatcmpl-1", 1700000000, "m")
            )

    def test_text_completion_chunks(self) -> None:
        """A text completion's chunks are ``text_completion`` objects with ``text``, the
        finish chunk's text empty."""
        piece = bodies.delta_chunk(TEXT, 2, "ab")
        self.assertEqual(piece["object"], "text_completion")
        self.assertEqual(
            piece["choices"],
            [{"index": 2, "text": "ab", "logprobs": None, "finish_reason": None}],
        )
        end = bodies.finish_chunk(TEXT, 2, "stop")
        self.assertEqual(
            end["choices"], [{"index": 2, "text": "", "logprobs": None, "finish_reason": "stop"}]
        )

    def test_usage_chunk_and_events(self) -> None:
        """The usage chunk has no choices and the three counts; an event is ``data: JSON``
        and a blank line; a stream ends with ``data: [DONE]``."""
        chunk = bodies.usage_chunk(CHAT, 5, 7)
        self.assertEqual(chunk["choices"], [])
        self.assertEqual(
            chunk["usage"], {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
        )
        self.assertEqual(json.loads(bodies.event(chunk)[len(b"data: ") : -2]), chunk)
        self.assertTrue(bodies.event(chunk).endswith(b"\n\n"))
        self.assertEqual(bodies.DONE, b"data: [DONE]\n\n")


class BodyTests(SynchronousTestCase):
    def test_chat_and_text_completions(self) -> None:
        """A whole chat completion lists each choice's assistant message, a text completion
        its text; both carry usage and the object name OpenAI uses."""
        choices = [bodies.ChoiceBody(0, "a", "stop"), bodies.ChoiceBody(1, "b", "length")]
        chat = bodies.completion(CHAT, choices, 3, 2)
        self.assertEqual(chat["object"], "chat.completion")
        self.assertEqual(chat["choices"][1]["message"], {"role": "assistant", "content": "b"})
        self.assertEqual(chat["choices"][1]["finish_reason"], "length")
        self.assertEqual(chat["usage"]["total_tokens"], 5)
        text = bodies.completion(TEXT, choices, 3, 2)
        self.assertEqual(text["object"], "text_completion")
        self.assertEqual(
            text["choices"][0], {"index": 0, "text": "a", "logprobs": None, "finish_reason": "stop"}
        )

    def test_error_shape(self) -> None:
        """An error is ``{"error": {"message", "type", "param", "code"}}``, as HttpError
        answers it."""
        error = HttpError(400, "bad", param="n", code="invalid_value")
        self.assertEqual(
            error.body(),
            {"error": {"message": "bad", "type": "invalid_request_error", "param": "n",
                       "code": "invalid_value"}},
        )  # fmt: skip

    def test_ids(self) -> None:
        """Completion ids are ``chatcmpl-`` or ``cmpl-`` and differ each time."""
        self.assertTrue(bodies.new_ident(True).startswith("chatcmpl-"))
        self.assertTrue(bodies.new_ident(False).startswith("cmpl-"))
        self.assertNotEqual(bodies.new_ident(True), bodies.new_ident(True))

    def test_models_and_health(self) -> None:
        """A model entry shows an unknown window as null and how many nodes serve it; the
        health body names each count."""
        entry = bodies.model_entry("m", 0, 2)
        self.assertIsNone(entry["context_length"])
        self.assertEqual(entry["nodes"], 2)
        self.assertEqual(bodies.model_list([entry]), {"object": "list", "data": [entry]})
        self.assertEqual(
            bodies.health("ok", nodes=1, lanes_active=2, lanes_total=4, queued=0, requests=3),
            {"status": "ok", "nodes": 1, "lanes_active": 2, "lanes_total": 4, "queued": 0,
             "requests": 3},
        )  # fmt: skip
