"""Text at the head: the tokenizer, chat-template rendering, detokenizing and stop strings.

Nodes only see token ids; the head turns messages and prompts into ids and ids back into text.
:class:`HeadTokenizer` does it with the ``tokenizers`` package and the model's chat template in
a jinja2 sandbox, read from a model folder's ``tokenizer.json``, ``tokenizer_config.json`` and
``chat_template.jinja``: the head never imports torch or transformers for it, so it starts in
about a second.  Folders without ``tokenizer.json`` (and tests that hand in a transformers
tokenizer) go through :class:`TransformersCodec`, which behaves the same.

:class:`Renderer` is what the HTTP layer uses: chat and completion prompts to ids, a cheap upper
bound on how many characters a window can hold (so a huge prompt is refused before it is
tokenized), and :class:`Detokenizer` and :class:`StopText` for streamed text that never splits a
character and never shows a stop string.

This module must never import torch or transformers at import time, never load model weights,
and never touch the reactor: rendering and tokenizing run on the HTTP layer's worker threads.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from sfnode.head.schema import ApiError, ChatMessage, clip

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class TokenizerLoadError(Exception):
    """A tokenizer folder cannot be read; the message names the file and the cause."""


class TextCodec(Protocol):
    """What the head needs of a tokenizer."""

    @property
    def vocab_size(self) -> int:
        """One more than the largest token id (ids from 0 to this minus 1 are valid)."""

    @property
    def longest_token(self) -> int:
        """The most characters one token can stand for (a bound for the cheap length check)."""

    @property
    def eos_token_id(self) -> int | None: ...

    def encode(self, text: str, *, special: bool) -> list[int]:
        """Token ids of ``text``, with the tokenizer's own special tokens (BOS) if ``special``."""

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens left out."""

    def render_chat(self, messages: Sequence[ChatMessage]) -> str:
        """The messages through the chat template, with the assistant's turn opened."""

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a part of a character, or a special token's own
        text); what OpenAI's logprobs call ``bytes``."""


def plain_chat(messages: Sequence[ChatMessage]) -> str:
    """The template of a tokenizer without one (test tokenizers): ``<|role|>\\ncontent\\n``
    per message, then ``<|assistant|>\\n``."""
    return "".join(f"<|{m.role}|>\n{m.content}\n" for m in messages) + "<|assistant|>\n"


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _clean_up_spaces(text: str) -> str:
    """transformers' ``clean_up_tokenization`` (for tokenizers that ask for it)."""
    for before, after in (
        (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
        (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"),
    ):  # fmt: skip
        text = text.replace(before, after)
    return text


def _template_environment() -> Any:
    """The jinja2 sandbox chat templates run in, with the helpers transformers gives them."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}`` (marks the assistant's text for
        training masks): renders its body unchanged."""

        tags = {"generation"}

        def parse(self, parser: Any) -> list[nodes.Node]:
            next(parser.stream)
            body: list[nodes.Node] = parser.parse_statements(
                ("name:endgeneration",), drop_needle=True
            )
            return body

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationTag, "jinja2.ext.loopcontrols"],
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    return environment


class HeadTokenizer:
    """A model folder's tokenizer and chat template, without torch or transformers.

    Reads ``tokenizer.json`` (the ``tokenizers`` package; its post-processor decides which
    special tokens a prompt gets, as it does for transformers' ``TokenizersBackend``),
    ``tokenizer_config.json`` (special tokens, ``clean_up_tokenization_spaces``, an inline
    ``chat_template``) and ``chat_template.jinja``.

    :raises TokenizerLoadError: a file is missing or unreadable.
    """

    def __init__(self, folder: str | Path) -> None:
        from tokenizers import Tokenizer

        self.folder = Path(folder)
        path = self.folder / TOKENIZER_FILE
        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:
            raise TokenizerLoadError(f"cannot read {path}: {e}") from e
        config = self._read_json(CONFIG_FILE)
        legacy_map = self._read_json("special_tokens_map.json")
        self.special_tokens: dict[str, str] = {}
        for name in SPECIAL_TOKEN_NAMES:
            text = _token_text(config.get(name)) or _token_text(legacy_map.get(name))
            if text is not None:
                self.special_tokens[name] = text
        self._clean_up = bool(config.get("clean_up_tokenization_spaces", False)) and (
            type(self._tokenizer.model).__name__ != "BPE"
        )
        self.chat_template = self._chat_template(config)
        self._template: Any = None
        if self.chat_template is not None:
            try:
                self._template = _template_environment().from_string(self.chat_template)
            except Exception as e:
                raise TokenizerLoadError(
                    f"the chat template of {self.folder} is invalid: {e}"
                ) from e
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        self._vocab_size = max(vocab.values(), default=-1) + 1
        self._longest = max((len(t) for t in vocab), default=1)
        eos = self.special_tokens.get("eos_token")
        self._eos = self._tokenizer.token_to_id(eos) if eos is not None else None

    def _read_json(self, name: str) -> dict[str, Any]:
        path = self.folder / name
        if not path.is_file():
            return {}
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise TokenizerLoadError(f"cannot read {path}: {e}") from e
        return data if isinstance(data, dict) else {}

    def _chat_template(self, config: Mapping[str, Any]) -> str | None:
        path = self.folder / TEMPLATE_FILE
        if path.is_file():
            try:
                return path.read_text(encoding="utf-8")
            except OSError as e:
                raise TokenizerLoadError(f"cannot read {path}: {e}") from e
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return template if isinstance(template, str) else None

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def longest_token(self) -> int:
        return self._longest

    @property
    def eos_token_id(self) -> int | None:
        return self._eos

    def encode(self, text: str, *, special: bool) -> list[int]:
        # The batch encoders release the GIL while they work (``encode`` holds it throughout,
        # which would stall the reactor for seconds on a big prompt); the fast one skips the
        # character offsets the head does not use, twice as fast on long texts.
        encoder = getattr(self._tokenizer, "encode_batch_fast", self._tokenizer.encode_batch)
        ids: list[int] = encoder([text], add_special_tokens=special)[0].ids
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        text: str = self._tokenizer.decode(list(ids), skip_special_tokens=True)
        return _clean_up_spaces(text) if self._clean_up else text

    def token_bytes(self, token_id: int) -> bytes:
        return piece_bytes(self._tokenizer, token_id, self.decode)

    def render_chat(self, messages: Sequence[ChatMessage]) -> str:
        if self._template is None:
            return plain_chat(messages)
        rendered: str = self._template.render(
            messages=[{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt=True,
            tools=None,
            documents=None,
            **self.special_tokens,
        )
        return rendered


class TransformersCodec:
    """A transformers tokenizer as a :class:`TextCodec` (tests, and folders without
    ``tokenizer.json``)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        self._vocab_size = max(max(vocab.values(), default=-1) + 1, len(tokenizer))
        self._longest = max((len(t) for t in vocab), default=1)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def longest_token(self) -> int:
        return self._longest

    @property
    def eos_token_id(self) -> int | None:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return eos if isinstance(eos, int) else None

    def encode(self, text: str, *, special: bool) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=special)]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def token_bytes(self, token_id: int) -> bytes:
        backend = getattr(self.tokenizer, "backend_tokenizer", None)  # fast tokenizers only
        return piece_bytes(backend, token_id, self.decode)

    def render_chat(self, messages: Sequence[ChatMessage]) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            return plain_chat(messages)
        return str(
            self.tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in messages],
                tokenize=False,
                add_generation_prompt=True,
            )
        )


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's ``bytes_to_unicode``): the character each byte is
    written as in a vocabulary, mapped back to the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_BYTE_LEVEL = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_METASPACE = "\u2581"


def piece_bytes(backend: Any, token_id: int, decode: Callable[[Sequence[int]], str]) -> bytes:
    """The bytes ``token_id`` stands for, read from the vocabulary of ``backend`` (a
    ``tokenizers.Tokenizer``, or None).

    Byte-level BPE vocabularies write each byte as one character of :func:`_byte_level_alphabet`;
    SentencePiece-style ones write a space as U+2581 and a lone byte as ``<0xNN>``; a special
    (added) token is its own text.  Anything else is the token decoded alone.
    """
    piece: str | None = backend.id_to_token(token_id) if backend is not None else None
    if piece is None:
        return decode([token_id]).encode()
    from tokenizers import decoders

    if isinstance(backend.decoder, decoders.ByteLevel) and all(c in _BYTE_LEVEL for c in piece):
        return bytes(_BYTE_LEVEL[c] for c in piece)
    fallback = _BYTE_FALLBACK.fullmatch(piece)
    if fallback is not None:
        return bytes([int(fallback.group(1), 16)])
    if _METASPACE in piece:
        return piece.replace(_METASPACE, " ").encode()
    text: str = decode([token_id]) or piece
    return text.encode()


def token_text(data: bytes) -> str:
    """A token's bytes as OpenAI's logprobs name the token: its text, or ``bytes:\\xNN...``
    when the bytes are not whole UTF-8 characters."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def as_codec(tokenizer: Any) -> TextCodec:
    """``tokenizer`` as a :class:`TextCodec`: itself if it is one, else a transformers
    tokenizer wrapped."""
    if isinstance(tokenizer, (HeadTokenizer, TransformersCodec)):
        return tokenizer
    return TransformersCodec(tokenizer)


class Renderer:
    """Messages and prompts to token ids, ids to text, with one tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.codec = as_codec(tokenizer)
        self._pieces: dict[int, bytes] = {}

    def chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        try:
            text = self.codec.render_chat(messages)
        except Exception as e:
            from jinja2 import TemplateError

            if not isinstance(e, TemplateError):
                raise
            raise ApiError(
                400,
                f"the model's chat template refused these messages: {clip(str(e), 200)}",
                param="messages",
            ) from e
        return self.codec.encode(text, special=False)

    def completion(self, prompt: str) -> list[int]:
        return self.codec.encode(prompt, special=True)

    def decode(self, tokens: Sequence[int]) -> str:
        return self.codec.decode(tokens)

    def detokenizer(self) -> Detokenizer:
        return Detokenizer(self.decode)

    def token_bytes(self, token_id: int) -> bytes:
        """What :meth:`TextCodec.token_bytes` says, remembered (logprobs ask for the same
        few thousand tokens again and again)."""
        found = self._pieces.get(token_id)
        if found is None:
            found = self._pieces[token_id] = self.codec.token_bytes(token_id)
        return found

    def character_bound(self, window: int) -> int:
        """More characters than this cannot fit in ``window`` tokens (each token stands for at
        most :attr:`TextCodec.longest_token` characters)."""
        return window * max(self.codec.longest_token, 1)


class Detokenizer:
    """Incremental detokenizing that never emits half a character.

    The text of the tokens since ``prefix`` is decoded again as tokens arrive; new text is
    released only when it does not end in U+FFFD (an incomplete UTF-8 sequence, most likely).
    """

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, tokens: Sequence[int]) -> str:
        self._ids.extend(tokens)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) > len(prefix_text) and not text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Whatever is held back (at the end of the stream, even an incomplete character)."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return text[len(prefix_text) :] if len(text) > len(prefix_text) else ""


class StopText:
    """Cuts the text at the first stop string; holds back what could start one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._text = ""
        self._sent = 0
        self.stopped = False

    def feed(self, delta: str) -> str:
        """The text that may be shown now."""
        if self.stopped:
            return ""
        self._text += delta
        if self._stops:
            start = max(0, self._sent - self._hold)
            hits = [i for i in (self._text.find(s, start) for s in self._stops) if i >= 0]
            if hits:
                self.stopped = True
                return self._release(min(hits))
        return self._release(len(self._text) - self._hold)

    def flush(self) -> str:
        return "" if self.stopped else self._release(len(self._text))

    def _release(self, end: int) -> str:
        if end <= self._sent:
            return ""
        out, self._sent = self._text[self._sent : end], end
        return out


__all__ = [
    "Detokenizer",
    "HeadTokenizer",
    "Renderer",
    "StopText",
    "TextCodec",
    "TokenizerLoadError",
    "TransformersCodec",
    "as_codec",
    "piece_bytes",
    "plain_chat",
    "token_text",
]
