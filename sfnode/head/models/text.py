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

Prompts cannot forge roles: text a client sends is tokenized as text.  A special token spelled
out in a message's content (``<|im_start|>``, ``<|im_end|>``, ...) becomes the ordinary tokens of
its characters, never the special id; only the chat template itself puts special ids in a
prompt (:meth:`Renderer.chat` renders the messages with such spellings masked, cuts the
rendered text at the template's own special tokens, and encodes the pieces between them with
special-token parsing off).  A ``/v1/completions`` string prompt follows the same rule unless
the operator allows special tokens; token-id prompts are the way to send special ids.

A chat template is code from a model file: :class:`RenderBudget` lets another thread stop a
render that runs past its time limit, so a hostile template cannot hold a worker for ever, and
the sandbox (:mod:`sfnode.head.models.sandbox`) bounds every value it builds and the text it
renders.

This module must never import torch or transformers at import time, never load model weights,
and never touch the reactor: rendering and tokenizing run on the HTTP layer's worker threads.
"""

from __future__ import annotations

import ctypes
import json
import re
import secrets
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from sfnode.head.models.chat import ChatMessage
from sfnode.head.models.sandbox import is_limit, render_bounded, template_environment
from sfnode.head.models.tools import client_texts, masked, template_message, template_messages
from sfnode.runtime.http_guard import HttpError, clip

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


DEFAULT_TEMPLATE_TIMEOUT_S = 5.0
"""How long one chat-template render may take (``twistd sfhead --template-timeout``)."""

_T = TypeVar("_T")


class TokenizerLoadError(Exception):
    """A tokenizer folder cannot be read; the message names the file and the cause."""


@dataclass(frozen=True, slots=True)
class SpecialToken:
    """A special (added) token as the tokenizer matches it in text."""

    text: str
    id: int
    lstrip: bool = False
    """The tokenizer's match takes the whitespace on its left with it."""
    rstrip: bool = False
    """... and on its right."""


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

    def encode(self, text: str, *, special: bool, parse_special: bool = False) -> list[int]:
        """Token ids of ``text``, with the tokenizer's own special tokens (BOS) if ``special``;
        a special token spelled out in ``text`` becomes its special id only if
        ``parse_special`` (else the tokens of its characters)."""

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens left out."""

    def specials(self) -> Sequence[SpecialToken]:
        """The tokenizer's special tokens (what ``parse_special`` turns into their ids)."""

    @property
    def has_chat_template(self) -> bool:
        """Whether the model's files carry a chat template (without one, chat is refused)."""

    def render_chat(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[Mapping[str, Any]] | None = None,
        cap: int | None = None,
    ) -> str:
        """The messages through the chat template, with the assistant's turn opened;
        ``tools`` for the template's ``tools`` variable (only when :attr:`knows_tools`);
        ``cap``: the most characters the render may build or write
        (:func:`sfnode.head.models.sandbox.render_bounded`).

        :raises NoChatTemplate: the model has none (:attr:`has_chat_template` is false)."""

    @property
    def knows_tools(self) -> bool:
        """Whether the chat template renders tools itself (its jinja reads ``tools``)."""

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a part of a character, or a special token's own
        text); what OpenAI's logprobs call ``bytes``."""

    def tokenizer_json(self) -> str | None:
        """The tokenizer as ``tokenizer.json`` text (what the grammar library reads,
        :mod:`sfnode.head.models.floors`); None for a tokenizer without one."""


class NoChatTemplate(Exception):
    """The model's files carry no chat template: its messages cannot be rendered (there is no
    rendering of one's own to fall back on: a guessed format gives a model text it was never
    trained on, and silently worse answers)."""


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


class HeadTokenizer:
    """A model folder's tokenizer and chat template, without torch or transformers.

    Reads ``tokenizer.json`` (the ``tokenizers`` package; its post-processor decides which
    special tokens a prompt gets, as it does for transformers' ``TokenizersBackend``),
    ``tokenizer_config.json`` (special tokens, ``clean_up_tokenization_spaces``, an inline
    ``chat_template``) and ``chat_template.jinja``, from a folder or from the files a node
    sent (:meth:`from_files`).

    :raises TokenizerLoadError: a file is missing or unreadable.
    """

    def __init__(
        self, folder: str | Path | None = None, *, files: Mapping[str, bytes] | None = None
    ) -> None:
        if (folder is None) == (files is None):
            raise TypeError("HeadTokenizer reads a folder or files, one of the two")
        self.folder = Path(folder) if folder is not None else None
        self._files = files
        self._load()

    @classmethod
    def from_files(cls, files: Mapping[str, bytes]) -> HeadTokenizer:
        """The tokenizer of a node's model files (docs/protocol.md section 12.5): the same
        files a folder holds, by name, with no folder at all."""
        return cls(files=files)

    def _where(self, name: str) -> str:
        return str(self.folder / name) if self.folder is not None else f"the node's {name}"

    def _read(self, name: str) -> str | None:
        """The text of the file ``name``; None when there is none."""
        try:
            if self._files is not None:
                data = self._files.get(name)
                return None if data is None else data.decode("utf-8")
            assert self.folder is not None
            path = self.folder / name
            return path.read_text(encoding="utf-8") if path.is_file() else None
        except (OSError, ValueError) as e:
            raise TokenizerLoadError(f"cannot read {self._where(name)}: {e}") from e

    def _load(self) -> None:
        from tokenizers import Tokenizer

        try:
            text = self._read(TOKENIZER_FILE)
            if text is None:
                raise TokenizerLoadError(f"there is no {self._where(TOKENIZER_FILE)}")
            self._tokenizer = Tokenizer.from_str(text)
            self._text_tokenizer: Any = None
            """A second instance for text, built when first needed (:meth:`_for_text`)."""
            self._text_lock = threading.Lock()
        except TokenizerLoadError:
            raise
        except Exception as e:
            raise TokenizerLoadError(f"cannot read {self._where(TOKENIZER_FILE)}: {e}") from e
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
                self._template = template_environment().from_string(self.chat_template)
            except Exception as e:
                where = self.folder if self.folder is not None else "the node's files"
                raise TokenizerLoadError(f"the chat template of {where} is invalid: {e}") from e
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values(), default=-1) + 1
        self.longest_token = max((len(t) for t in vocab), default=1)
        eos = self.special_tokens.get("eos_token")
        self.eos_token_id: int | None = (
            self._tokenizer.token_to_id(eos) if eos is not None else None
        )

    def _read_json(self, name: str) -> dict[str, Any]:
        text = self._read(name)
        if text is None:
            return {}
        try:
            data = json.loads(text)
        except ValueError as e:
            raise TokenizerLoadError(f"cannot read {self._where(name)}: {e}") from e
        return data if isinstance(data, dict) else {}

    def _chat_template(self, config: Mapping[str, Any]) -> str | None:
        template: Any = self._read(TEMPLATE_FILE)
        if template is not None:
            return str(template)
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return template if isinstance(template, str) else None

    def encode(self, text: str, *, special: bool, parse_special: bool = False) -> list[int]:
        # The batch encoders release the GIL while they work (``encode`` holds it throughout,
        # which would stall the reactor for seconds on a big prompt); the fast one skips the
        # character offsets the head does not use, twice as fast on long texts.
        tokenizer = self._tokenizer if parse_special else self._for_text()
        encoder = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
        ids: list[int] = encoder([text], add_special_tokens=special)[0].ids
        return ids

    def _for_text(self) -> Any:
        """The instance that encodes special tokens' spellings as text: a second one (the flag
        is per instance, and worker threads encode at once, so one instance's flag is never
        switched back and forth), built from the first when a request first needs it (a
        completion's prompt, a chat message spelling a special token): a head that serves
        only chats never holds it (about 10 MB for a vocabulary of 49,152 tokens)."""
        with self._text_lock:
            if self._text_tokenizer is None:
                from tokenizers import Tokenizer

                tokenizer = Tokenizer.from_str(self._tokenizer.to_str())
                tokenizer.encode_special_tokens = True
                self._text_tokenizer = tokenizer
            return self._text_tokenizer

    def decode(self, ids: Sequence[int]) -> str:
        text: str = self._tokenizer.decode(list(ids), skip_special_tokens=True)
        return _clean_up_spaces(text) if self._clean_up else text

    def specials(self) -> Sequence[SpecialToken]:
        return _specials(self._tokenizer.get_added_tokens_decoder())

    def token_bytes(self, token_id: int) -> bytes:
        return piece_bytes(self._tokenizer, token_id, self.decode)

    def tokenizer_json(self) -> str | None:
        return str(self._tokenizer.to_str())

    @property
    def knows_tools(self) -> bool:
        return _knows_tools(self.chat_template)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def render_chat(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[Mapping[str, Any]] | None = None,
        cap: int | None = None,
    ) -> str:
        if self._template is None:
            raise NoChatTemplate(f"{self.folder or 'the node files'} carry no chat template")
        return render_bounded(
            self._template,
            cap,
            messages=[template_message(m) for m in messages],
            add_generation_prompt=True,
            tools=list(tools) if tools else None,
            documents=None,
            **self.special_tokens,
        )


class TransformersCodec:
    """A transformers tokenizer as a :class:`TextCodec` (tests, and folders without
    ``tokenizer.json``)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        vocab = tokenizer.get_vocab()
        self.vocab_size = max(max(vocab.values(), default=-1) + 1, len(tokenizer))
        self.longest_token = max((len(t) for t in vocab), default=1)

    @property
    def eos_token_id(self) -> int | None:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return eos if isinstance(eos, int) else None

    def encode(self, text: str, *, special: bool, parse_special: bool = False) -> list[int]:
        # transformers switches the backend's special-token flag for the call: one call at a
        # time, or a worker thread's call could run with another's setting.
        with self._lock:
            ids = self.tokenizer.encode(
                text, add_special_tokens=special, split_special_tokens=not parse_special
            )
        return [int(t) for t in ids]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def specials(self) -> Sequence[SpecialToken]:
        return _specials(getattr(self.tokenizer, "added_tokens_decoder", {}))

    def token_bytes(self, token_id: int) -> bytes:
        backend = getattr(self.tokenizer, "backend_tokenizer", None)  # fast tokenizers only
        return piece_bytes(backend, token_id, self.decode)

    def tokenizer_json(self) -> str | None:
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        return None if backend is None else str(backend.to_str())

    @property
    def knows_tools(self) -> bool:
        return _knows_tools(getattr(self.tokenizer, "chat_template", None))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def render_chat(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[Mapping[str, Any]] | None = None,
        cap: int | None = None,
    ) -> str:
        # transformers' own sandbox renders here (tests only): the cap is not enforced.
        if not self.has_chat_template:
            raise NoChatTemplate("the tokenizer carries no chat template")
        return str(
            self.tokenizer.apply_chat_template(
                [template_message(m) for m in messages],
                tools=list(tools) if tools else None,
                tokenize=False,
                add_generation_prompt=True,
            )
        )


def _knows_tools(template: Any) -> bool:
    """Whether a chat template's source reads the ``tools`` variable (as llama.cpp decides
    whether a template supports tools)."""
    return isinstance(template, str) and re.search(r"\btools\b", template) is not None


def _specials(decoder: Mapping[int, Any]) -> list[SpecialToken]:
    """The special tokens of an added-tokens table (``{id: AddedToken}``)."""
    return [
        SpecialToken(str(token.content), int(i), bool(token.lstrip), bool(token.rstrip))
        for i, token in decoder.items()
        if getattr(token, "special", False) and token.content
    ]


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


class TemplateTimeout(BaseException):
    """Raised in a worker thread whose chat-template render ran out of time, between two of
    its Python instructions (a BaseException, so that no ``except Exception`` on the way can
    swallow it)."""


class RenderStopped(Exception):
    """The render was stopped by its :class:`RenderBudget` (or before it started)."""


def _raise_in(thread: int, exception: type[BaseException] | None) -> None:
    """Make ``thread`` raise ``exception`` at its next Python instruction (None: forget one that
    is pending)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread), None if exception is None else ctypes.py_object(exception)
    )


class RenderBudget:
    """A render that another thread may stop.

    :meth:`run` runs the render on the calling (worker) thread; :meth:`stop`, from any thread
    (the HTTP layer's timer), interrupts it there with :class:`TemplateTimeout` if it is still
    running, and :meth:`run` then raises :class:`RenderStopped`.  A lock orders the two, so the
    interruption lands inside the render or in :meth:`run`'s own cleanup, never in whatever the
    thread does next.  ``on_start`` is called on the worker thread as the render starts (where
    the HTTP layer arms its timer, so time spent waiting for a worker does not count).
    """

    def __init__(self, on_start: Callable[[], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._thread: int | None = None
        self._done = False
        self._on_start = on_start
        self.stopped = False

    def run(self, work: Callable[[], _T]) -> _T:
        """``work()`` on this thread, unless stopped first.

        :raises RenderStopped: :meth:`stop` came before the end (or before the start)."""
        with self._lock:
            if self._done:
                raise RenderStopped("stopped before it started")
            self._thread = thread = threading.get_ident()
        try:
            try:
                if self._on_start is not None:
                    self._on_start()
                return work()
            finally:
                with self._lock:
                    self._done = True
                    if self.stopped:
                        _raise_in(thread, None)
        except TemplateTimeout:
            raise RenderStopped("stopped by its time limit") from None

    def stop(self) -> None:
        """Stop the render now (nothing if it is over)."""
        with self._lock:
            if self._done or self.stopped:
                return
            self.stopped = True
            if self._thread is None:
                self._done = True
            else:
                _raise_in(self._thread, TemplateTimeout)


class Renderer:
    """Messages and prompts to token ids, ids to text, with one tokenizer.

    ``allow_special_tokens``: a completion's string prompt may spell special tokens that
    become their ids (``--allow-special-tokens``); chat messages never may.
    """

    def __init__(self, tokenizer: Any, *, allow_special_tokens: bool = False) -> None:
        self.codec = as_codec(tokenizer)
        self.allow_special_tokens = allow_special_tokens
        self._pieces: dict[int, bytes] = {}
        # Longest first: where two special tokens start at the same place the longer one is
        # what the tokenizer matches (leftmost-longest), and so does this pattern.
        specials = sorted(self.codec.specials(), key=lambda t: len(t.text), reverse=True)
        self._specials = {t.text: t for t in specials}
        self._special_names = list(self._specials)
        self._special_re = (
            re.compile("(" + "|".join(re.escape(t) for t in self._special_names) + ")")
            if specials
            else None
        )

    def chat(
        self,
        messages: Sequence[ChatMessage],
        budget: RenderBudget | None = None,
        tools: Sequence[Mapping[str, Any]] = (),
        cap: int | None = None,
    ) -> list[int]:
        """The prompt of ``messages``: the chat template's text, with the template's special
        tokens as their ids and the messages' text as text (a special token spelled out in a
        message is the tokens of its characters).  ``budget``: the render's time limit.
        ``tools`` (and the history's calls and results) go to a template that knows tools,
        else through the generic rendering (:func:`sfnode.head.models.tools.template_messages`).
        ``cap``: the most characters the template may build or render (what the window can
        hold; None: the sandbox's own bound).

        :raises HttpError: 400 when the template refuses the messages, passes ``cap`` or runs
            out of time (each naming the limit).
        :raises NoChatTemplate: the model has none (the HTTP layer refuses such a chat before
            it gets here, naming the model).
        """
        if not self.codec.has_chat_template:
            raise NoChatTemplate("the model's files carry no chat template")
        messages, rendered_tools = template_messages(messages, tools, self.codec.knows_tools)
        pattern = self._special_re
        if pattern is None or not any(
            pattern.search(text) for m in messages for text in client_texts(m)
        ):
            # Every special token in the text is the template's own.
            text = self._render(messages, budget, rendered_tools, cap)
            return self.codec.encode(text, special=False, parse_special=True)
        # Render with each spelled-out special token masked by a placeholder no client can
        # guess, cut the text at the template's special tokens (the only ones left), and
        # encode the pieces between them as text with the spellings put back: exactly what
        # the tokenizer does with added tokens, except that the client's are not among them.
        nonce = secrets.token_hex(8)
        index = {name: i for i, name in enumerate(self._special_names)}

        def mask(content: str) -> str:
            return pattern.sub(lambda m: f"\ue000{nonce}.{index[m.group()]}\ue001", content)

        text = self._render([masked(m, mask) for m in messages], budget, rendered_tools, cap)
        placeholder = re.compile("\ue000" + nonce + r"\.(\d+)\ue001")
        if nonce in placeholder.sub("", text):
            raise HttpError(
                400,
                "the model's chat template transformed a message holding a special token's "
                "spelling in a way this server cannot tokenize as text; send it without it",
                param="messages",
            )
        return self._encode_pieces(pattern.split(text), placeholder)

    def _encode_pieces(self, pieces: list[str], placeholder: re.Pattern[str]) -> list[int]:
        """The ids of a rendered text cut at the template's special tokens (every odd piece
        one of them), the clients' spellings (``placeholder``) put back as text."""
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2:
                ids.append(self._specials[piece].id)
                continue
            if i > 0 and self._specials[pieces[i - 1]].rstrip:
                piece = piece.lstrip()
            if i + 1 < len(pieces) and self._specials[pieces[i + 1]].lstrip:
                piece = piece.rstrip()
            if piece:
                piece = placeholder.sub(lambda m: self._special_names[int(m.group(1))], piece)
                ids.extend(self.codec.encode(piece, special=False, parse_special=False))
        return ids

    def _render(
        self,
        messages: Sequence[ChatMessage],
        budget: RenderBudget | None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        cap: int | None = None,
    ) -> str:
        try:
            if budget is None:
                return self.codec.render_chat(messages, tools, cap)
            return budget.run(lambda: self.codec.render_chat(messages, tools, cap))
        except RenderStopped as e:
            raise HttpError(
                400,
                "the model's chat template did not finish rendering these messages within "
                "the time a request may take (--template-timeout) and was stopped",
                param="messages",
                code="template_timeout",
            ) from e
        except HttpError:
            raise
        except Exception as e:
            from jinja2 import TemplateError

            if isinstance(e, TemplateError) and is_limit(e):
                raise HttpError(
                    400,
                    f"{clip(str(e), 200)}: the limit of a request on this server",
                    param="messages",
                    code="template_limit",
                ) from e
            # The template's own refusal (raise_exception), or a filter or test it called on
            # these messages failing (a TypeError in its code): its error, never the server's.
            reason = str(e) if isinstance(e, TemplateError) else f"{type(e).__name__}: {e}"
            raise HttpError(
                400,
                f"the model's chat template refused these messages: {clip(reason, 200)}",
                param="messages",
            ) from e

    @property
    def has_chat_template(self) -> bool:
        """Whether chat can be rendered at all (the model's files carry a chat template);
        completions never need one."""
        return self.codec.has_chat_template

    def completion(self, prompt: str) -> list[int]:
        """A completion's string prompt, with the tokenizer's BOS; a special token spelled out
        in it is text unless ``allow_special_tokens``."""
        return self.codec.encode(prompt, special=True, parse_special=self.allow_special_tokens)

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
        self.matched: str | None = None
        """The stop string the text was cut at (the first listed of those found first)."""

    def feed(self, delta: str) -> str:
        """The text that may be shown now."""
        if self.stopped:
            return ""
        self._text += delta
        if self._stops:
            start = max(0, self._sent - self._hold)
            hits = [(self._text.find(s, start), s) for s in self._stops]
            found = [(at, stop) for at, stop in hits if at >= 0]
            if found:
                self.stopped = True
                at, self.matched = min(found, key=lambda hit: hit[0])
                return self._release(at)
        return self._release(len(self._text) - self._hold)

    def flush(self) -> str:
        return "" if self.stopped else self._release(len(self._text))

    def _release(self, end: int) -> str:
        if end <= self._sent:
            return ""
        out, self._sent = self._text[self._sent : end], end
        return out


__all__ = [
    "DEFAULT_TEMPLATE_TIMEOUT_S",
    "Detokenizer",
    "HeadTokenizer",
    "NoChatTemplate",
    "RenderBudget",
    "RenderStopped",
    "Renderer",
    "SpecialToken",
    "StopText",
    "TemplateTimeout",
    "TextCodec",
    "TokenizerLoadError",
    "TransformersCodec",
    "as_codec",
    "piece_bytes",
    "token_text",
]
