"""Logprobs at the head (docs/protocol.md section 12.1): placement on nodes that offer them,
the token bytes and names OpenAI shows, and the ``logprobs`` objects of chat and completions.

Pure parts only (no reactor, no socket): :func:`sfnode.head.fleet.placement.with_features` and
:func:`~sfnode.head.fleet.placement.decide`, :func:`sfnode.head.models.text.piece_bytes` and
:func:`~sfnode.head.models.text.token_text`, :class:`sfnode.head.api.logprobs.ChoiceLogprobs`.
"""

from __future__ import annotations

from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from sfnode.generation import TokenLogprob
from sfnode.head.api.logprobs import ChoiceLogprobs
from sfnode.head.fleet.placement import (
    NodeView,
    Place,
    Policy,
    Request,
    TooLong,
    Unsupported,
    Wait,
    decide,
    with_features,
)
from sfnode.head.models.text import Renderer, piece_bytes, token_text
from sfnode.linkf.wire import FEATURE_LOGPROBS, CapacitySummary
from tests.tinymodel import tiny_tokenizer


def node(key: int, features: int | None, *, live: bool = True, window: int = 0) -> NodeView:
    return NodeView(
        key=key,
        live=live,
        capacity=CapacitySummary(max_context_tokens=window),
        report_age_s=1.0,
        features=features,
    )


ASKS = Request(model=None, length=10, features=FEATURE_LOGPROBS)


class PlacementTests(SynchronousTestCase):
    """A session that asks for logprobs goes only to nodes that offer them."""

    def test_only_nodes_with_the_bit_are_candidates(self) -> None:
        """Nodes without FEATURE_LOGPROBS are never chosen for a request that needs it, even
        when they are less loaded; a request that needs nothing may go anywhere."""
        views = [node(0, 0), node(1, FEATURE_LOGPROBS), node(2, 0)]
        self.assertEqual(decide(views, ASKS, Policy.LEAST_LOADED), Place((1,)))
        plain = Request(model=None, length=10)
        self.assertEqual(decide(views, plain, Policy.LEAST_LOADED), Place((0, 1, 2)))

    def test_refused_once_every_node_said_it_has_none(self) -> None:
        """When every node serving the model has handshaken without the bit, the request is
        refused (Unsupported); a node that never handshook (None) may have it, so the request
        waits; a node with the bit that is down is waited for, not refused."""
        said = [node(0, 0), node(1, 0, live=False)]
        self.assertEqual(decide(said, ASKS, Policy.LOAD_AWARE), Unsupported(FEATURE_LOGPROBS))
        self.assertEqual(with_features(said, FEATURE_LOGPROBS), Unsupported(FEATURE_LOGPROBS))
        unsaid = [node(0, 0), node(1, None, live=False)]
        self.assertIsInstance(decide(unsaid, ASKS, Policy.LOAD_AWARE), Wait)
        down = [node(0, 0), node(1, FEATURE_LOGPROBS, live=False)]
        self.assertIsInstance(decide(down, ASKS, Policy.LOAD_AWARE), Wait)
        self.assertEqual(with_features(said, 0), said)

    def test_too_long_is_judged_by_the_nodes_that_offer_them(self) -> None:
        """The window that counts for a request that needs logprobs is the largest among the
        nodes that offer them: a prompt only a node without the bit could hold is too long."""
        views = [node(0, 0, window=4096), node(1, FEATURE_LOGPROBS, window=64)]
        asks = Request(model=None, length=100, features=FEATURE_LOGPROBS)
        self.assertEqual(decide(views, asks, Policy.LOAD_AWARE), TooLong(100, 64))


class _ByteLevelVocab:
    """A stand-in ``tokenizers.Tokenizer`` over a few pieces (id -> vocabulary string)."""

    def __init__(self, pieces: dict[int, str], decoder: Any) -> None:
        self.pieces = pieces
        self.decoder = decoder

    def id_to_token(self, token_id: int) -> str | None:
        return self.pieces.get(token_id)


class TokenBytesTests(SynchronousTestCase):
    """The bytes a token stands for, and the name OpenAI gives it."""

    def test_byte_level_pieces_map_back_to_their_bytes(self) -> None:
        """Byte-level BPE writes a space as "Ġ" and each byte of a multi-byte character as
        one character: the bytes come back exactly, half a character included; an added
        token is its own text."""
        from tokenizers import decoders

        vocab = _ByteLevelVocab(
            {1: "Ġworld", 2: "ä½", 3: "ł", 4: "<|im_end|>"}, decoders.ByteLevel()
        )
        decode = lambda ids: "?"  # noqa: E731  (never reached for these pieces)
        self.assertEqual(piece_bytes(vocab, 1, decode), b" world")
        self.assertEqual(piece_bytes(vocab, 2, decode), "你".encode()[:2])
        self.assertEqual(piece_bytes(vocab, 2, decode) + piece_bytes(vocab, 3, decode),
                         "你".encode())  # fmt: skip
        self.assertEqual(piece_bytes(vocab, 4, decode), b"<|im_end|>")

    def test_sentencepiece_pieces_and_byte_fallback(self) -> None:
        """SentencePiece-style vocabularies: U+2581 is a space, <0xNN> one byte; without a
        vocabulary the token is decoded alone."""
        from tokenizers import decoders

        vocab = _ByteLevelVocab({1: "\u2581hello", 2: "<0xE4>"}, decoders.Metaspace())
        self.assertEqual(piece_bytes(vocab, 1, lambda ids: "?"), b" hello")
        self.assertEqual(piece_bytes(vocab, 2, lambda ids: "?"), b"\xe4")
        self.assertEqual(piece_bytes(None, 7, lambda ids: "seven"), b"seven")

    def test_names_are_text_or_escaped_bytes(self) -> None:
        """Whole UTF-8 is the token's text; anything else is named bytes:\\xNN... as OpenAI
        does."""
        self.assertEqual(token_text(b" world"), " world")
        self.assertEqual(token_text(b"\xe4\xbd"), "bytes:\\xe4\\xbd")

    def test_the_tiny_tokenizers_pieces_rebuild_its_text(self) -> None:
        """For the tiny byte-level tokenizer, the bytes of a text's tokens joined are the
        text's UTF-8 (the renderer's remembered answers included)."""
        renderer = Renderer(tiny_tokenizer())
        text = "hello world, the quick brown fox"
        ids = renderer.codec.encode(text, special=False)
        self.assertEqual(b"".join(renderer.token_bytes(i) for i in ids), text.encode())
        self.assertEqual(b"".join(renderer.token_bytes(i) for i in ids), text.encode())


PIECES = {10: b"Hel", 11: b"lo", 12: b" wor", 13: b"ld", 20: b"\xe4\xbd"}


def lp(value: float, *top: tuple[int, float]) -> TokenLogprob:
    return TokenLogprob(value, tuple(top))


class RenderingTests(SynchronousTestCase):
    """ChoiceLogprobs: OpenAI's shapes, chunked for streams and whole for answers."""

    def test_chat_entries(self) -> None:
        """Chat: each entry has token, logprob, bytes and top_logprobs (at most as many as
        asked, best first); the object is {"content": [...], "refusal": null}."""
        choice = ChoiceLogprobs(True, 2, PIECES.__getitem__)
        choice.add(10, lp(-0.25, (10, -0.25), (11, -2.0), (12, -3.0)), 0)
        choice.add(20, lp(-1.5, (13, -0.5), (20, -1.5), (11, -4.0)), 3)
        self.assertEqual(
            choice.whole(),
            {
                "content": [
                    {
                        "token": "Hel",
                        "logprob": -0.25,
                        "bytes": [72, 101, 108],
                        "top_logprobs": [
                            {"token": "Hel", "logprob": -0.25, "bytes": [72, 101, 108]},
                            {"token": "lo", "logprob": -2.0, "bytes": [108, 111]},
                        ],
                    },
                    {
                        "token": "bytes:\\xe4\\xbd",
                        "logprob": -1.5,
                        "bytes": [0xE4, 0xBD],
                        "top_logprobs": [
                            {"token": "ld", "logprob": -0.5, "bytes": [108, 100]},
                            {"token": "bytes:\\xe4\\xbd", "logprob": -1.5, "bytes": [0xE4, 0xBD]},
                        ],
                    },
                ],
                "refusal": None,
            },
        )

    def test_chat_without_top_logprobs_lists_no_alternatives(self) -> None:
        """logprobs: true without top_logprobs gives empty top_logprobs lists."""
        choice = ChoiceLogprobs(True, 0, PIECES.__getitem__)
        choice.add(11, lp(-0.5, (11, -0.5)), 0)
        self.assertEqual(choice.whole()["content"][0]["top_logprobs"], [])

    def test_completion_entries(self) -> None:
        """Completions: tokens, token_logprobs, top_logprobs (the N best and the chosen token,
        up to N + 1 entries) and text_offset."""
        choice = ChoiceLogprobs(False, 1, PIECES.__getitem__)
        choice.add(10, lp(-0.25, (10, -0.25)), 0)
        choice.add(11, lp(-2.0, (12, -0.1)), 3)
        self.assertEqual(
            choice.whole(),
            {
                "tokens": ["Hel", "lo"],
                "token_logprobs": [-0.25, -2.0],
                "top_logprobs": [{"Hel": -0.25}, {" wor": -0.1, "lo": -2.0}],
                "text_offset": [0, 3],
            },
        )

    def test_chunks_take_what_came_since_the_last(self) -> None:
        """take() gives the entries added since the previous take (streamed chunks); pending
        says whether there are any; whole() still gives every entry."""
        choice = ChoiceLogprobs(False, 0, PIECES.__getitem__)
        self.assertFalse(choice.pending)
        choice.add(10, lp(-0.25), 0)
        choice.add(11, lp(-0.5), 3)
        self.assertTrue(choice.pending)
        self.assertEqual(choice.take()["tokens"], ["Hel", "lo"])
        self.assertFalse(choice.pending)
        choice.add(12, lp(-0.75), 5)
        self.assertEqual(choice.take()["text_offset"], [5])
        self.assertEqual(choice.take()["tokens"], [])
        self.assertEqual(choice.whole()["tokens"], ["Hel", "lo", " wor"])
