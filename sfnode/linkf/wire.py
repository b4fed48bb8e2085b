"""Link F on the wire: the frame envelope, the streaming decoder and the typed message catalog.

Layered like AMP: :func:`encode_frame` and :class:`FrameDecoder` know only the envelope
(docs/protocol.md section 2); the message classes below know only their msgpack payloads (sections 3
and 4); nothing here does I/O, keeps connection state beyond a byte buffer, or knows what a message
means.  Every error this module raises on bad input is a :class:`WireError`, so a caller can close
one connection on it and carry on.

Payload rules (docs/protocol.md section 3): a struct is an array of its fields in declaration order,
integers are checked against their declared width, ``[u8; 32]`` is a bin of exactly 32 bytes,
enums are ``[index, ...fields]``, maps and extension types are rejected anywhere, trailing bytes
after the one object are an error, and extra trailing array elements are ignored.
"""

from __future__ import annotations

import enum
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Generic, NamedTuple, TypeVar

import msgpack

PROTO_VERSION = 2
HEADER_LEN = 21
"""Bytes of the header that ``len`` counts: version, type, seq, correlation id, class."""
MAX_FRAME = 16 * 1024 * 1024
"""The largest ``len`` (header plus payload) a frame may declare."""
MAX_PAYLOAD = MAX_FRAME - HEADER_LEN
DROPPABLE_BIT = 0x8000

CLASS_REQUIRED = 0
CLASS_DROPPABLE = 1

FINISH_NONE = 0
FINISH_EOS = 1
FINISH_LENGTH = 2
FINISH_GRAMMAR = 3
FINISH_CANCELLED = 4
FINISH_ERROR = 5
FINISH_EXPIRED = 0xFFFF_FFFF
FINISH_REFUSED = 0xFFFF_FFFE
FINISH_DECLINED = 0xFFFF_FFFD
FINISH_DETAIL_CLOSED = 1 << 0
"""Bit of a Finish's ``detail``: the node closed the constrained output early, within its
budget, so that it ends with its grammar's end (docs/protocol.md section 12.6)."""

U32_MAX = 0xFFFF_FFFF
U64_MAX = 0xFFFF_FFFF_FFFF_FFFF

FEATURE_LOGPROBS = 1 << 0
"""HELLO_ACK_F feature flag: the node returns logprobs when GenParams ask (docs/protocol.md
section 12.1)."""
MAX_TOP_LOGPROBS = 20
"""The most alternatives a TokensLogprobs event lists per token (OpenAI's top_logprobs)."""
LOGPROBS_MAX = MAX_TOP_LOGPROBS + 1
"""The largest ``GenParams.logprobs``: the chosen token and 20 alternatives."""
FEATURE_REQUEST_CLASS = 1 << 1
"""HELLO_ACK_F feature flag: the node reads the request class of GENERATE_REQ and admits
interactive generations ahead of batch ones (docs/protocol.md section 12.2)."""
FEATURE_CONSTRAINTS = 1 << 2
"""HELLO_ACK_F feature flag: the node honours the constraint of GENERATE_REQ (a grammar its
output must follow and the sampler's per-lane controls; docs/protocol.md section 12.3)."""
MAX_GRAMMAR_BYTES = 1 << 20
"""The longest JSON text (a schema, a tools list) a constraint may carry, in UTF-8 bytes."""
MAX_LOGIT_BIAS = 1024
"""The most entries a constraint's ``logit_bias`` may list."""
MAX_REPETITION_WINDOW = 1 << 16
"""The longest window ``repetition_penalty`` may look back over, in tokens."""
FEATURE_HEAD_IDENTITY = 1 << 3
"""HELLO_ACK_F feature flag: the node keeps the sessions of each head identity (the HELLO's
``head_id``) apart from every other head's (docs/protocol.md section 12.4, decision D13)."""
FEATURE_MODEL_FILES = 1 << 4
"""HELLO_ACK_F feature flag: the node sends its head the files its text layer reads to serve
its model (tokenizer, chat template), named by a content hash in HELLO_ACK_F and fetched with
BLOB_FETCH and the transfer messages (docs/protocol.md section 12.5, D21-D22)."""
FEATURE_CLOSING = 1 << 5
"""HELLO_ACK_F feature flag: the node closes a constrained output within its ``max_new`` and
says so in the Finish's ``detail`` (docs/protocol.md section 12.6, D23)."""
FEATURE_EMBEDDINGS = 1 << 6
"""HELLO_ACK_F feature flag: the node serves its model as an embedding model: it answers
EMBED_REQ and generates nothing (docs/protocol.md section 12.7, D24)."""
FEATURE_STAGE_KV = 1 << 7
"""HELLO_ACK_F feature flag: the node's pipeline stages keep their KV per stage session
(STAGE_FORWARD_REQ's appended ``stage_session`` and ``position``, STAGE_RELEASE;
docs/protocol.md section 12.8, D26)."""
FEATURE_STAGE_BATCH = 1 << 8
"""HELLO_ACK_F feature flag (set only with :data:`FEATURE_STAGE_KV`): the node reads
STAGE_BATCH_REQ, the kept-stage rows of several stage sessions in one frame, and answers them
in one STAGE_BATCH_RESP (docs/protocol.md section 12.8, D28)."""
FEATURE_STAGE_RING = 1 << 9
"""HELLO_ACK_F feature flag (set only with :data:`FEATURE_STAGE_BATCH`, by a node that
listens): the node joins stage rings, STAGE_RING_JOIN, STAGE_RING_ROWS and STAGE_RING_TOKENS
(docs/protocol.md section 12.10, D29)."""

_ENVELOPE = struct.Struct("<IHHQQB")
_LENGTH = struct.Struct("<I")


class MsgType(enum.IntEnum):
    """The 28 message types of the Link F catalog and sfnode's own of sections 12.7, 12.8 and
    12.10 (docs/protocol.md section 4.1)."""

    HELLO = 0x0001
    HELLO_ACK_F = 0x0002
    RECONCILE = 0x0003
    RECONCILE_ACK = 0x0004
    SESSION_ASSIGN = 0x0005
    SESSION_REVOKE = 0x0006
    POLICY_UPDATE = 0x0007
    LEASE_RENEW = 0x0008
    LEASE_GRANT = 0x0009
    APPEND_CONTENT = 0x000A
    GENERATE_REQ = 0x000B
    PARK_REQ = 0x000C
    RESUME_REQ = 0x000D
    TOKEN_EVENTS = 0x000E
    WATERMARK_ACK = 0x000F
    XFER_BEGIN = 0x0010
    XFER_CHUNK = 0x0011
    XFER_END = 0x0012
    XFER_ABORT = 0x0013
    STATE_SHIP = 0x0014
    STATE_FETCH = 0x0015
    BLOB_FETCH = 0x0016
    NODE_STATUS = 0x0017
    GENERATE_CANCEL = 0x0018
    STAGE_FORWARD_REQ = 0x0019
    STAGE_FORWARD_RESP = 0x001A
    EMBED_REQ = 0x001B
    EMBED_RESP = 0x001C
    STAGE_RELEASE = 0x001D
    STAGE_BATCH_REQ = 0x001E
    STAGE_BATCH_RESP = 0x001F
    STAGE_RING_JOIN = 0x0020
    STAGE_RING_ROWS = 0x0021
    STAGE_RING_TOKENS = 0x0022
    TELEMETRY = 0x8001
    KEEPALIVE = 0x8002


_KNOWN_TYPES = frozenset(int(t) for t in MsgType)

SMALL_PAYLOAD = 1024
"""The limit of the messages made of a few integers (decision D14)."""
HANDSHAKE_PAYLOAD = 4096
"""HELLO: versions, a role, a fleet token (64 characters) and a head identity."""
STATUS_PAYLOAD = 8192
"""HELLO_ACK_F and NODE_STATUS: an identity, a capacity sample and the list of model names."""
PAYLOAD_LIMITS: dict[int, int] = {
    int(t): limit
    for t, limit in {
        MsgType.HELLO: HANDSHAKE_PAYLOAD,
        MsgType.HELLO_ACK_F: STATUS_PAYLOAD,
        MsgType.RECONCILE: MAX_PAYLOAD,
        MsgType.RECONCILE_ACK: MAX_PAYLOAD,
        MsgType.SESSION_ASSIGN: 64 * 1024,
        MsgType.SESSION_REVOKE: SMALL_PAYLOAD,
        MsgType.POLICY_UPDATE: 64 * 1024,
        MsgType.LEASE_RENEW: SMALL_PAYLOAD,
        MsgType.LEASE_GRANT: SMALL_PAYLOAD,
        MsgType.APPEND_CONTENT: MAX_PAYLOAD,
        MsgType.GENERATE_REQ: 2 * 1024 * 1024,
        MsgType.PARK_REQ: SMALL_PAYLOAD,
        MsgType.RESUME_REQ: SMALL_PAYLOAD,
        MsgType.TOKEN_EVENTS: MAX_PAYLOAD,
        MsgType.WATERMARK_ACK: SMALL_PAYLOAD,
        MsgType.XFER_BEGIN: SMALL_PAYLOAD,
        MsgType.XFER_CHUNK: MAX_PAYLOAD,
        MsgType.XFER_END: SMALL_PAYLOAD,
        MsgType.XFER_ABORT: SMALL_PAYLOAD,
        MsgType.STATE_SHIP: MAX_PAYLOAD,
        MsgType.STATE_FETCH: MAX_PAYLOAD,
        MsgType.BLOB_FETCH: SMALL_PAYLOAD,
        MsgType.NODE_STATUS: STATUS_PAYLOAD,
        MsgType.GENERATE_CANCEL: SMALL_PAYLOAD,
        MsgType.STAGE_FORWARD_REQ: MAX_PAYLOAD,
        MsgType.STAGE_FORWARD_RESP: MAX_PAYLOAD,
        MsgType.EMBED_REQ: MAX_PAYLOAD,
        MsgType.EMBED_RESP: MAX_PAYLOAD,
        MsgType.STAGE_RELEASE: SMALL_PAYLOAD,
        MsgType.STAGE_BATCH_REQ: MAX_PAYLOAD,
        MsgType.STAGE_BATCH_RESP: MAX_PAYLOAD,
        MsgType.STAGE_RING_JOIN: SMALL_PAYLOAD,
        MsgType.STAGE_RING_ROWS: MAX_PAYLOAD,
        MsgType.STAGE_RING_TOKENS: MAX_PAYLOAD,
        MsgType.TELEMETRY: MAX_PAYLOAD,
        MsgType.KEEPALIVE: SMALL_PAYLOAD,
    }.items()
}
"""The largest payload each message type may carry (docs/protocol.md section 2.3, decision
D14): what its fields can need with room for appended ones.  A frame that declares more is
refused from its header, before its body is buffered or unpacked; an unknown droppable type
(skipped, never unpacked) is held to ``MAX_FRAME`` only."""


def frame_class(msg_type: int) -> int:
    """The class byte a frame of this type must carry (docs/protocol.md section 2.2)."""
    return CLASS_DROPPABLE if msg_type & DROPPABLE_BIT else CLASS_REQUIRED


# --------------------------------------------------------------------------------------------
# Errors


class WireError(Exception):
    """Bad bytes from a peer.  Fatal to the connection that sent them, and to nothing else.

    When :meth:`FrameDecoder.feed` raises one, ``frames_before`` holds the whole frames that
    arrived ahead of the bad bytes, in order, so the caller can still handle them.
    """

    frames_before: list[Frame]

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.frames_before = []


class BadLength(WireError):
    """A frame declares ``len`` < 21."""


class FrameTooLarge(WireError):
    """A frame declares (or an encoder was asked for) ``len`` > MAX_FRAME."""


class ClassRangeMismatch(WireError):
    """A class byte that is not 0 or 1, or does not match the type's range."""


class UnknownRequiredType(WireError):
    """A type number in the Required range that the Link F catalog does not have."""


class Truncated(WireError):
    """The stream ended in the middle of a frame."""


class PayloadError(WireError):
    """A payload that is not the msgpack shape its message type declares."""


class PayloadTooLarge(WireError):
    """A frame whose payload is larger than its message type's limit (``PAYLOAD_LIMITS``), or
    larger than the handshake's own limit before the handshake frame arrived."""


# --------------------------------------------------------------------------------------------
# Envelope


class Frame(NamedTuple):
    """One decoded envelope; the payload is not decoded yet."""

    msg_type: int
    seq: int
    payload: bytes


def encode_frame(msg_type: int, seq: int, payload: bytes, frame_cls: int | None = None) -> bytes:
    """The bytes of one frame.  ``frame_cls`` defaults to the class the type implies."""
    expected = frame_class(msg_type)
    if frame_cls is not None and frame_cls != expected:
        raise ClassRangeMismatch(f"type 0x{msg_type:04x} needs class {expected}, not {frame_cls}")
    length = HEADER_LEN + len(payload)
    if length > MAX_FRAME:
        raise FrameTooLarge(f"frame of {length} bytes exceeds MAX_FRAME {MAX_FRAME}")
    _check_payload_limit(msg_type, len(payload))
    return _ENVELOPE.pack(length, PROTO_VERSION, msg_type, seq, 0, expected) + payload


def _check_payload_limit(msg_type: int, size: int) -> None:
    """The sender's side of ``PAYLOAD_LIMITS``: nothing a receiver would refuse is written."""
    limit = PAYLOAD_LIMITS.get(msg_type, MAX_PAYLOAD)
    if size > limit:
        raise PayloadTooLarge(
            f"a {_type_label(msg_type)} payload of {size} bytes exceeds its limit of {limit}"
        )


def _type_label(msg_type: int) -> str:
    try:
        return MsgType(msg_type).name
    except ValueError:
        return f"0x{msg_type:04x}"


class FrameDecoder:
    """A streaming decoder: feed it bytes, get whole frames (docs/protocol.md section 2.4).

    Unknown Droppable types are skipped here and never delivered.  A frame whose payload is
    larger than its type's limit (``PAYLOAD_LIMITS``, decision D14) is refused as soon as its
    header is in, before its body is buffered.  ``handshake`` names the frame a connection
    starts with (HELLO on the node, HELLO_ACK_F on the head): until one of that type has been
    decoded, every frame is held to that type's limit, so a peer that has not shaken hands
    cannot make the decoder buffer more.  After an error the decoder is unusable; the caller
    closes the connection.
    """

    def __init__(self, handshake: MsgType | None = None) -> None:
        self._buffer = bytearray()
        self._needed = 4
        """Bytes the buffer must hold before the next frame can be complete."""
        self._handshake = None if handshake is None else int(handshake)
        """The type that lifts the handshake cap once decoded; None when there is no cap."""
        self._cap = MAX_PAYLOAD if handshake is None else PAYLOAD_LIMITS[int(handshake)]

    @property
    def buffered(self) -> int:
        """Bytes held that do not yet make a whole frame."""
        return len(self._buffer)

    def feed_whole(self, data: bytes) -> tuple[list[Frame], WireError | None]:
        """Like :meth:`feed`, without raising: the frames ``data`` completes, and the error of
        the bad bytes after them (None if there are none).  The frames are whole and are
        handled before a connection closes for the error."""
        try:
            return self.feed(data), None
        except WireError as e:
            return e.frames_before, e

    def feed(self, data: bytes) -> list[Frame]:
        """Add bytes; return every frame they complete, in order.

        Bad bytes raise a :class:`WireError` whose ``frames_before`` are the frames ahead of
        them (whole, and to be handled before the connection closes).
        """
        if self._buffer:
            self._buffer += data
            if len(self._buffer) < self._needed:
                return []
            buffer = bytes(self._buffer)
        else:
            buffer = bytes(data)
        self._needed = 4
        frames: list[Frame] = []
        offset = 0
        available = len(buffer)
        unpack_length = _LENGTH.unpack_from
        unpack_envelope = _ENVELOPE.unpack_from
        limit_of = PAYLOAD_LIMITS.get
        try:
            while available - offset >= 4:
                if available - offset >= 25:
                    # The whole envelope is here: one unpack for the length and the header.
                    length, _, msg_type, seq, _, cls = unpack_envelope(buffer, offset)
                else:
                    (length,) = unpack_length(buffer, offset)
                if length < HEADER_LEN:
                    raise BadLength(f"frame length {length} is below the header length 21")
                if length > MAX_FRAME:
                    raise FrameTooLarge(f"frame length {length} exceeds MAX_FRAME {MAX_FRAME}")
                if available - offset < 25:
                    # The type is not known yet: wait for the whole header (a frame is at least
                    # 25 bytes), whose type says how much body may follow.
                    self._needed = 25
                    break
                size = length - HEADER_LEN
                if size > self._cap or size > limit_of(msg_type, MAX_PAYLOAD):
                    raise self._too_large(msg_type, size)
                end = offset + 4 + length
                if end > available:
                    self._needed = 4 + length
                    break
                payload = buffer[offset + 25 : end]
                offset = end
                if cls != (1 if msg_type & DROPPABLE_BIT else 0):
                    raise ClassRangeMismatch(f"type 0x{msg_type:04x} arrived with class {cls}")
                if msg_type not in _KNOWN_TYPES:
                    if msg_type & DROPPABLE_BIT:
                        continue
                    raise UnknownRequiredType(f"unknown required message type 0x{msg_type:04x}")
                if msg_type == self._handshake:
                    self._handshake, self._cap = None, MAX_PAYLOAD
                frames.append(Frame(msg_type, seq, payload))
        except WireError as e:
            e.frames_before = frames
            raise
        finally:
            self._buffer = bytearray(buffer[offset:]) if offset < len(buffer) else bytearray()
        return frames

    def _too_large(self, msg_type: int, size: int) -> PayloadTooLarge:
        limit = PAYLOAD_LIMITS.get(msg_type, MAX_PAYLOAD)
        if size <= limit and self._handshake is not None:
            return PayloadTooLarge(
                f"a {_type_label(msg_type)} frame of {size} payload bytes before the "
                f"{_type_label(self._handshake)} (the limit before it is {self._cap})"
            )
        return PayloadTooLarge(
            f"a {_type_label(msg_type)} payload of {size} bytes exceeds its limit of {limit}"
        )

    def finish(self) -> None:
        """The stream ended: raise :class:`Truncated` if part of a frame is still buffered."""
        if self._buffer:
            raise Truncated(f"stream ended with {len(self._buffer)} bytes of an unfinished frame")


# --------------------------------------------------------------------------------------------
# Payload codecs: one small object per wire type, composed into per-message codecs.

T = TypeVar("T")


class Codec(Generic[T]):
    """Turns a value into a msgpack-ready object and back, validating on the way in."""

    def encode(self, value: T) -> Any:
        raise NotImplementedError

    def decode(self, obj: Any) -> T:
        raise NotImplementedError


class UInt(Codec[int]):
    def __init__(self, bits: int) -> None:
        self.bits = bits
        self.limit = 1 << bits

    def encode(self, value: int) -> Any:
        if type(value) is not int or not 0 <= value < self.limit:
            raise PayloadError(f"{value!r} does not fit u{self.bits}")
        return value

    def decode(self, obj: Any) -> int:
        if type(obj) is not int:
            raise PayloadError(f"expected u{self.bits}, got {type(obj).__name__}")
        if not 0 <= obj < self.limit:
            raise PayloadError(f"{obj} is outside u{self.bits}")
        return obj


class Bool(Codec[bool]):
    def encode(self, value: bool) -> Any:
        return bool(value)

    def decode(self, obj: Any) -> bool:
        if type(obj) is not bool:
            raise PayloadError(f"expected bool, got {type(obj).__name__}")
        return obj


_F32 = struct.Struct("<f")


def to_f32(value: float) -> float:
    """``value`` rounded to the nearest float32, as a Python float."""
    try:
        (narrowed,) = _F32.unpack(_F32.pack(value))
    except OverflowError:
        narrowed = float("inf") if value > 0 else float("-inf")
    return float(narrowed)


class F32(Codec[float]):
    def encode(self, value: float) -> Any:
        return float(value)

    def decode(self, obj: Any) -> float:
        if type(obj) is float or type(obj) is int:
            return to_f32(float(obj))
        raise PayloadError(f"expected f32, got {type(obj).__name__}")


class Str(Codec[str]):
    def encode(self, value: str) -> Any:
        return value

    def decode(self, obj: Any) -> str:
        if type(obj) is not str:
            raise PayloadError(f"expected str, got {type(obj).__name__}")
        return obj


class Bin(Codec[bytes]):
    def __init__(self, exact: int | None = None) -> None:
        self.exact = exact

    def encode(self, value: bytes) -> Any:
        if self.exact is not None and len(value) != self.exact:
            raise PayloadError(f"expected exactly {self.exact} bytes, got {len(value)}")
        return bytes(value)

    def decode(self, obj: Any) -> bytes:
        if type(obj) is not bytes:
            raise PayloadError(f"expected bin, got {type(obj).__name__}")
        if self.exact is not None and len(obj) != self.exact:
            raise PayloadError(f"expected exactly {self.exact} bytes, got {len(obj)}")
        return obj


class ArrayOf(Codec[tuple[T, ...]]):
    def __init__(self, item: Codec[T]) -> None:
        self.item = item

    def encode(self, value: tuple[T, ...]) -> Any:
        return [self.item.encode(v) for v in value]

    def decode(self, obj: Any) -> tuple[T, ...]:
        if type(obj) is not list:
            raise PayloadError(f"expected array, got {type(obj).__name__}")
        return tuple([self.item.decode(v) for v in obj])


_INT_ONLY = frozenset({int})


class U32Array(Codec[tuple[int, ...]]):
    """``Vec<u32>``: the hot path of token events, checked without a per-item call."""

    def encode(self, value: tuple[int, ...]) -> Any:
        self.check(value)
        return value

    @staticmethod
    def check(items: Sequence[Any]) -> None:
        """Every item an int (not a bool) in u32 range.

        ``array("I")`` checks range and type in C but takes bools for 0 and 1; only a list
        that holds a value equal to 0 or 1 is walked item by item to rule them out.
        """
        try:
            array("I", items)
            valid = not (True in items or False in items) or not any(type(v) is bool for v in items)
        except (OverflowError, TypeError):
            valid = False
        if not valid:
            bad = next(v for v in items if type(v) is not int or not 0 <= v <= U32_MAX)
            raise PayloadError(f"{bad!r} is not a u32")

    def decode(self, obj: Any) -> tuple[int, ...]:
        if type(obj) is not list:
            raise PayloadError(f"expected array, got {type(obj).__name__}")
        self.check(obj)
        return tuple(obj)


class Optional(Codec["T | None"]):
    def __init__(self, inner: Codec[T]) -> None:
        self.inner = inner

    def encode(self, value: T | None) -> Any:
        return None if value is None else self.inner.encode(value)

    def decode(self, obj: Any) -> T | None:
        return None if obj is None else self.inner.decode(obj)


class Pair(Codec[tuple[int, int]]):
    """A tuple ``(A, B)`` of two integers of one width."""

    def __init__(self, item: UInt) -> None:
        self.item = item

    def encode(self, value: tuple[int, int]) -> Any:
        return [self.item.encode(value[0]), self.item.encode(value[1])]

    def decode(self, obj: Any) -> tuple[int, int]:
        if type(obj) is not list or len(obj) < 2:
            raise PayloadError("expected a 2-element array")
        return (self.item.decode(obj[0]), self.item.decode(obj[1]))


E = TypeVar("E", bound=enum.IntEnum)


class UnitEnum(Codec[E]):
    """An enum whose variants carry nothing: ``[index]``."""

    def __init__(self, enum_cls: type[E]) -> None:
        self.enum_cls = enum_cls

    def encode(self, value: E) -> Any:
        return [int(value)]

    def decode(self, obj: Any) -> E:
        if type(obj) is not list or not obj or type(obj[0]) is not int:
            raise PayloadError(f"expected [{self.enum_cls.__name__} index]")
        try:
            return self.enum_cls(obj[0])
        except ValueError:
            raise PayloadError(f"{obj[0]} is not a {self.enum_cls.__name__} variant") from None


S = TypeVar("S", bound="Struct")


class StructCodec(Codec[S]):
    """A struct: an array of its fields in declaration order."""

    def __init__(self, cls: type[S]) -> None:
        self.cls = cls

    def encode(self, value: S) -> Any:
        return value.to_wire()

    def decode(self, obj: Any) -> S:
        return self.cls.from_wire(obj)


class Struct:
    """Base of every wire struct: dataclass fields plus a parallel tuple of codecs."""

    FIELDS: ClassVar[tuple[Codec[Any], ...]] = ()

    @classmethod
    def _field_names(cls) -> tuple[str, ...]:
        names: tuple[str, ...] | None = cls.__dict__.get("_NAMES")
        if names is None:
            names = tuple(f.name for f in fields(cls))  # type: ignore[arg-type]
            if len(names) != len(cls.FIELDS):
                raise TypeError(f"{cls.__name__}: {len(names)} fields, {len(cls.FIELDS)} codecs")
            type.__setattr__(cls, "_NAMES", names)
        return names

    def to_wire(self) -> list[Any]:
        return [
            codec.encode(getattr(self, name))
            for codec, name in zip(self.FIELDS, self._field_names(), strict=True)
        ]

    @classmethod
    def from_wire(cls: type[S], obj: Any) -> S:
        codecs = cls.FIELDS
        if type(obj) is not list:
            raise PayloadError(f"{cls.__name__}: expected array, got {type(obj).__name__}")
        if len(obj) < len(codecs):
            raise PayloadError(f"{cls.__name__}: expected {len(codecs)} fields, got {len(obj)}")
        return cls(*[c.decode(v) for c, v in zip(codecs, obj, strict=False)])

    @classmethod
    def as_codec(cls: type[S]) -> StructCodec[S]:
        return StructCodec(cls)


U8 = UInt(8)
U16 = UInt(16)
U32 = UInt(32)
U64 = UInt(64)
BOOL = Bool()
FLOAT32 = F32()
STR = Str()
BIN = Bin()
HASH32 = Bin(32)
U32S = U32Array()


def _unreadable_map(_pairs: Any) -> Any:
    raise PayloadError("maps are not used on Link F")


def _unreadable_ext(code: int, _data: bytes) -> Any:
    raise PayloadError(f"msgpack extension type {code} is not used on Link F")


def _holds_timestamp(obj: Any) -> bool:
    pending = [obj]
    while pending:
        item = pending.pop()
        if type(item) is list:
            pending.extend(item)
        elif type(item) is msgpack.Timestamp:
            return True
    return False


def unpack(payload: bytes) -> Any:
    """One msgpack object, strictly: no maps, no extensions, no trailing bytes."""
    try:
        obj = msgpack.unpackb(
            payload,
            raw=False,
            use_list=True,
            strict_map_key=True,
            object_pairs_hook=_unreadable_map,
            ext_hook=_unreadable_ext,
        )
    except PayloadError:
        raise
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise PayloadError(f"not one msgpack object: {e}") from e
    # msgpack decodes extension type -1 (timestamp) itself, without calling ext_hook.  A
    # timestamp is 4, 8 or 12 bytes, so its header ends in d6 ff, d7 ff, or a length byte
    # 04, 08 or 0c then ff: only payloads holding one of those pairs are walked.
    if (
        0xFF in payload  # an int needle is a plain memchr, ten times cheaper than b"\xff"
        and (
            b"\xd6\xff" in payload
            or b"\xd7\xff" in payload
            or b"\x04\xff" in payload
            or b"\x08\xff" in payload
            or b"\x0c\xff" in payload
        )
        and _holds_timestamp(obj)
    ):
        raise PayloadError("msgpack extension type -1 (timestamp) is not used on Link F")
    return obj


_PACKER = msgpack.Packer(use_bin_type=True, use_single_float=True)


def pack(obj: Any) -> bytes:
    """msgpack bytes of ``obj``; floats are float32, the only floats Link F carries."""
    try:
        return _PACKER.pack(obj)  # type: ignore[no-any-return]
    except (ValueError, TypeError, OverflowError) as e:
        raise PayloadError(f"cannot encode {type(obj).__name__}: {e}") from e


# --------------------------------------------------------------------------------------------
# Shared types (docs/protocol.md section 4.2)


class LinkRole(enum.IntEnum):
    NODE_AGENT = 0
    WORKER = 1
    HEAD_DAEMON = 2


class SegmentKind(enum.IntEnum):
    TEXT_DELTA = 0
    REASONING_DELTA = 1
    TOOL_CALL_DELTA = 2


@dataclass(frozen=True, slots=True)
class CapacitySummary(Struct):
    gpu_memory_bytes: int = 0
    gpu_memory_free_bytes: int = 0
    host_memory_bytes: int = 0
    active_sessions: int = 0
    max_sessions: int = U32_MAX
    max_context_tokens: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    lanes_active: int = 0
    max_lanes: int = 0
    queue_depth: int = 0
    decode_tokens_per_s: int = 0
    prefill_tokens_per_s: int = 0
    sampled_at_ms: int = 0
    FIELDS = (U64, U64, U64, U32, U32, U64, U64, U64, U32, U32, U32, U32, U32, U64)


@dataclass(frozen=True, slots=True)
class LinkFLimits(Struct):
    max_frame: int = MAX_FRAME
    transfer_window: int = 8
    max_transfer: int = 1 << 26
    transfer_budget: int = 1 << 28
    FIELDS = (U32, U32, U64, U64)


@dataclass(frozen=True, slots=True)
class Lease(Struct):
    duration_ms: int
    renew_by_ms: int
    FIELDS = (U64, U64)


@dataclass(frozen=True, slots=True)
class LeaseStateMsg(Struct):
    lease: Lease
    elapsed_ms: int
    FIELDS = (Lease.as_codec(), U64)


@dataclass(frozen=True, slots=True)
class GenerationWatermark(Struct):
    generation_id: int
    watermark: int | None
    FIELDS = (U64, Optional(U64))


@dataclass(frozen=True, slots=True)
class SessionReconcileState(Struct):
    session_id: int
    epoch: int
    lease_state: LeaseStateMsg
    command_watermark: int
    generation_watermarks: tuple[GenerationWatermark, ...]
    FIELDS = (U64, U64, LeaseStateMsg.as_codec(), U64, ArrayOf(GenerationWatermark.as_codec()))


@dataclass(frozen=True, slots=True)
class RetryRange(Struct):
    generation_id: int
    from_seq: int
    to_seq: int
    FIELDS = (U64, U64, U64)


@dataclass(frozen=True, slots=True)
class SessionReconcileAck(Struct):
    session_id: int
    held: bool
    retry_ranges: tuple[RetryRange, ...]
    lease_view: LeaseStateMsg
    FIELDS = (U64, BOOL, ArrayOf(RetryRange.as_codec()), LeaseStateMsg.as_codec())


@dataclass(frozen=True, slots=True)
class TokenSpan(Struct):
    start: int
    end: int
    FIELDS = (U64, U64)


@dataclass(frozen=True, slots=True)
class GenerationBudgetsMsg(Struct):
    max_new_tokens: int
    max_wall_ms: int = 0
    FIELDS = (U64, U64)


@dataclass(frozen=True, slots=True)
class UsageMsg(Struct):
    input_tokens: int
    output_tokens: int
    FIELDS = (U64, U64)


@dataclass(frozen=True, slots=True)
class MemCountersMsg(Struct):
    allocated_bytes: int = 0
    host_retained_bytes: int = 0
    pool_blocks_total: int = 0
    pool_blocks_used: int = 0
    pool_bytes_evictable: int = 0
    tentative_bytes: int = 0
    FIELDS = (U64, U64, U64, U64, U64, U64)


# TokenEventPayload: a tagged union (M11).


# The token-event classes below are the hot path of Link F (one per event, both ends).  They
# are plain (not frozen) slotted dataclasses because a frozen one costs three times as much to
# build (bench/wire.py); treat them as values all the same.


@dataclass(slots=True)
class Tokens:
    tokens: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Segment:
    kind: SegmentKind
    data: bytes


@dataclass(frozen=True, slots=True)
class Usage:
    usage: UsageMsg


@dataclass(slots=True)
class Finish:
    reason: int
    detail: int = 0
    """Bits that say more about the end (:data:`FINISH_DETAIL_CLOSED`); written only when not
    0 (docs/protocol.md section 12.6)."""


@dataclass(slots=True)
class TokensLogprobs(Tokens):
    """Tokens with their log probabilities: variant 4, sent only to a generation whose
    GenParams asked for them, on a link whose node set ``FEATURE_LOGPROBS``
    (docs/protocol.md section 12.1).  A :class:`Tokens` to code that knows only tokens."""

    logprobs: tuple[float, ...]
    """ln of the probability the sampler drew each token with."""
    top: tuple[tuple[tuple[int, float], ...], ...]
    """Per token, up to ``GenParams.logprobs - 1`` (id, logprob) pairs, most likely first;
    empty (no entry at all) when only the chosen tokens' logprobs were asked for."""


TokenEventPayload = Tokens | Segment | Usage | Finish

_SEGMENT_KIND = UnitEnum(SegmentKind)
_USAGE = UsageMsg.as_codec()


class TokenEventPayloadCodec(Codec[TokenEventPayload]):
    def encode(self, value: TokenEventPayload) -> Any:
        if type(value) is Tokens:
            # On the way out, array("I") is check enough: it refuses floats, strings,
            # negatives and values past u32.  Receivers do the full check.
            try:
                array("I", value.tokens)
            except (OverflowError, TypeError) as e:
                raise PayloadError(f"Tokens {value.tokens!r} do not fit u32: {e}") from e
            return [0, value.tokens]
        if type(value) is TokensLogprobs:
            _check_logprobs(value)
            return [
                4,
                list(value.tokens),
                [float(v) for v in value.logprobs],
                [[[i, float(v)] for i, v in alternatives] for alternatives in value.top],
            ]
        if isinstance(value, Segment):
            return [1, _SEGMENT_KIND.encode(value.kind), BIN.encode(value.data)]
        if isinstance(value, Usage):
            return [2, _USAGE.encode(value.usage)]
        assert isinstance(value, Finish)
        if value.detail:
            return [3, U32.encode(value.reason), U32.encode(value.detail)]
        return [3, U32.encode(value.reason)]

    def decode(self, obj: Any) -> TokenEventPayload:
        if type(obj) is not list or not obj:
            raise PayloadError("expected a TokenEventPayload array")
        tag = obj[0]
        if tag == 0 and len(obj) >= 2 and type(tag) is int:
            tokens = obj[1]
            if type(tokens) is not list:
                raise PayloadError("Tokens: expected an array")
            U32Array.check(tokens)
            return Tokens(tuple(tokens))
        if tag == 1 and len(obj) >= 3 and type(tag) is int:
            return Segment(_SEGMENT_KIND.decode(obj[1]), BIN.decode(obj[2]))
        if tag == 2 and len(obj) >= 2 and type(tag) is int:
            return Usage(_USAGE.decode(obj[1]))
        if tag == 3 and len(obj) >= 2 and type(tag) is int:
            return Finish(U32.decode(obj[1]), U32.decode(obj[2]) if len(obj) >= 3 else 0)
        if tag == 4 and len(obj) >= 4 and type(tag) is int:
            return _decode_logprobs(obj[1], obj[2], obj[3])
        raise PayloadError(f"bad TokenEventPayload {obj[:1]!r} of {len(obj)} elements")


F32_MAX = 3.4028234663852886e38
"""The largest finite float32: the most negative logprob a TokensLogprobs event carries is its
negative."""


def _logprob(value: Any) -> float:
    """A logprob as read: an f32 (or int) that is finite and not above 0."""
    if (type(value) is not float and type(value) is not int) or not -F32_MAX <= value <= 0:
        raise PayloadError(f"{value!r} is not a logprob (a finite f32, 0 or less)")
    return to_f32(float(value))


def _check_logprobs(value: TokensLogprobs) -> None:
    """What a receiver would refuse, refused before sending."""
    U32Array.check(value.tokens)
    if len(value.logprobs) != len(value.tokens):
        raise PayloadError("TokensLogprobs: one logprob per token")
    if value.top and len(value.top) != len(value.tokens):
        raise PayloadError("TokensLogprobs: top is empty or one list per token")
    for v in value.logprobs:
        _logprob(v)
    for alternatives in value.top:
        if len(alternatives) > MAX_TOP_LOGPROBS:
            raise PayloadError(f"TokensLogprobs: more than {MAX_TOP_LOGPROBS} alternatives")
        for i, v in alternatives:
            U32.encode(i)
            _logprob(v)


def _decode_logprobs(tokens: Any, logprobs: Any, top: Any) -> TokensLogprobs:
    if type(tokens) is not list or type(logprobs) is not list or type(top) is not list:
        raise PayloadError("TokensLogprobs: expected tokens, logprobs and top arrays")
    U32Array.check(tokens)
    if len(logprobs) != len(tokens):
        raise PayloadError("TokensLogprobs: one logprob per token")
    if top and len(top) != len(tokens):
        raise PayloadError("TokensLogprobs: top is empty or one list per token")
    alternatives: list[tuple[tuple[int, float], ...]] = []
    for entry in top:
        if type(entry) is not list or len(entry) > MAX_TOP_LOGPROBS:
            raise PayloadError(
                f"TokensLogprobs: a top list is an array of at most {MAX_TOP_LOGPROBS} pairs"
            )
        pairs = []
        for pair in entry:
            if type(pair) is not list or len(pair) < 2:
                raise PayloadError("TokensLogprobs: a top entry is an [id, logprob] pair")
            pairs.append((U32.decode(pair[0]), _logprob(pair[1])))
        alternatives.append(tuple(pairs))
    return TokensLogprobs(tuple(tokens), tuple(_logprob(v) for v in logprobs), tuple(alternatives))


@dataclass(slots=True)
class TokenEvent(Struct):
    session_id: int
    epoch: int
    generation_id: int
    event_seq: int
    payload: TokenEventPayload
    FIELDS = (U64, U64, U64, U64, TokenEventPayloadCodec())


# --------------------------------------------------------------------------------------------
# Messages (docs/protocol.md section 4.3)


class Message(Struct):
    """A Link F message: a struct with a catalog number."""

    MSG_TYPE: ClassVar[MsgType]

    def payload(self) -> bytes:
        obj = self.to_wire()
        try:
            return _PACKER.pack(obj)  # type: ignore[no-any-return]
        except (ValueError, TypeError, OverflowError) as e:
            raise PayloadError(f"cannot encode {type(self).__name__}: {e}") from e


@dataclass(frozen=True, slots=True)
class Hello(Message):
    """HELLO.  ``head_id`` is the optional fourth element of docs/protocol.md section 12.4: a
    head's identity, which a node with ``FEATURE_HEAD_IDENTITY`` keeps its sessions under.
    None (not written: the three-element HELLO every node reads) is a head without one."""

    proto_versions: tuple[int, int]
    link_role: LinkRole
    auth: bytes
    head_id: int | None = None
    MSG_TYPE = MsgType.HELLO
    FIELDS = (Pair(U16), UnitEnum(LinkRole), BIN, Optional(U64))

    def to_wire(self) -> list[Any]:
        wire = Struct.to_wire(self)
        return wire if self.head_id is not None else wire[:3]

    @classmethod
    def from_wire(cls, obj: Any) -> Hello:
        if type(obj) is list and len(obj) == 3:
            obj = [*obj, None]
        message: Hello = super(Hello, cls).from_wire(obj)
        return message


@dataclass(frozen=True, slots=True)
class ModelFilesOffer(Struct):
    """HELLO_ACK_F's optional seventh element (docs/protocol.md section 12.5): the content
    hash (SHA-256) of the bundle of the node's model files, and its length in bytes."""

    content_hash: bytes
    total_len: int
    FIELDS = (HASH32, U64)


@dataclass(frozen=True, slots=True)
class HelloAckF(Message):
    """HELLO_ACK_F.  ``model_files`` is the optional seventh element of section 12.5 (None:
    not written, the six-element message every head reads); ``refused`` the optional eighth of
    section 5.2 (D25: why the node serves no model; written only when set, after a nil
    seventh when there are no files)."""

    chosen_version: int
    node_identity: str
    capacity: CapacitySummary
    loadable_models: tuple[str, ...]
    feature_flags: int
    limits: LinkFLimits
    model_files: ModelFilesOffer | None = None
    refused: str | None = None
    MSG_TYPE = MsgType.HELLO_ACK_F
    FIELDS = (
        U16,
        STR,
        CapacitySummary.as_codec(),
        ArrayOf(STR),
        U64,
        LinkFLimits.as_codec(),
        Optional(ModelFilesOffer.as_codec()),
        Optional(STR),
    )

    def to_wire(self) -> list[Any]:
        wire = Struct.to_wire(self)
        if self.refused is not None:
            return wire
        return wire[:7] if self.model_files is not None else wire[:6]

    @classmethod
    def from_wire(cls, obj: Any) -> HelloAckF:
        if type(obj) is list and len(obj) in (6, 7):
            obj = [*obj, *[None] * (8 - len(obj))]
        message: HelloAckF = super(HelloAckF, cls).from_wire(obj)
        return message


@dataclass(frozen=True, slots=True)
class ReconcileMsg(Message):
    sessions: tuple[SessionReconcileState, ...]
    MSG_TYPE = MsgType.RECONCILE
    FIELDS = (ArrayOf(SessionReconcileState.as_codec()),)


@dataclass(frozen=True, slots=True)
class ReconcileAckMsg(Message):
    sessions: tuple[SessionReconcileAck, ...]
    MSG_TYPE = MsgType.RECONCILE_ACK
    FIELDS = (ArrayOf(SessionReconcileAck.as_codec()),)


@dataclass(frozen=True, slots=True)
class SessionAssignMsg(Message):
    command_id: int
    session_id: int
    epoch: int
    lease: Lease
    codec: str
    params: bytes
    qos_class: int
    policy_ref: int
    MSG_TYPE = MsgType.SESSION_ASSIGN
    FIELDS = (U64, U64, U64, Lease.as_codec(), STR, BIN, U8, U64)


@dataclass(frozen=True, slots=True)
class SessionRevokeMsg(Message):
    command_id: int
    session_id: int
    epoch: int
    MSG_TYPE = MsgType.SESSION_REVOKE
    FIELDS = (U64, U64, U64)


@dataclass(frozen=True, slots=True)
class PolicyUpdateMsg(Message):
    policy_version: int
    envelope: bytes
    MSG_TYPE = MsgType.POLICY_UPDATE
    FIELDS = (U64, BIN)


@dataclass(frozen=True, slots=True)
class LeaseRenewMsg(Message):
    session_id: int
    epoch: int
    MSG_TYPE = MsgType.LEASE_RENEW
    FIELDS = (U64, U64)


@dataclass(frozen=True, slots=True)
class LeaseGrantMsg(Message):
    session_id: int
    epoch: int
    duration_ms: int
    renew_by_ms: int
    MSG_TYPE = MsgType.LEASE_GRANT
    FIELDS = (U64, U64, U64, U64)


@dataclass(frozen=True, slots=True)
class AppendContentMsg(Message):
    command_id: int
    session_id: int
    epoch: int
    blocks: bytes
    spans: tuple[TokenSpan, ...] = ()
    media_refs: tuple[bytes, ...] = ()
    MSG_TYPE = MsgType.APPEND_CONTENT
    FIELDS = (U64, U64, U64, BIN, ArrayOf(TokenSpan.as_codec()), ArrayOf(HASH32))


# Constraints (docs/protocol.md section 12.3): what a generation's output must follow, and the
# sampler's per-lane controls.


class ToolChoice(enum.IntEnum):
    """Which calls a tools grammar lets the output make (OpenAI's ``tool_choice``)."""

    NONE = 0
    """Text only: the output never opens a call."""
    AUTO = 1
    """Text, or text followed by calls: once a call opens it follows the grammar."""
    REQUIRED = 2
    """Calls only, of any declared tool."""
    FUNCTION = 3
    """Calls only, of the one tool named."""


@dataclass(frozen=True, slots=True)
class JsonObjectGrammar:
    """``[0]``: the output is one JSON object (OpenAI's ``{"type": "json_object"}``)."""


@dataclass(frozen=True, slots=True)
class JsonSchemaGrammar:
    """``[1, schema]``: the output is one JSON value that validates against ``schema`` (the
    schema's JSON text)."""

    schema: str


@dataclass(frozen=True, slots=True)
class ToolsGrammar:
    """``[2, tools, choice, function, parallel]``: the output calls the declared tools.

    ``tools`` is the JSON text of an array of ``{"name": ..., "parameters": {...}}`` objects;
    ``function`` names the one tool of :attr:`ToolChoice.FUNCTION` (empty otherwise);
    ``parallel`` false allows one call only.
    """

    tools: str
    choice: ToolChoice
    function: str = ""
    parallel: bool = True


Grammar = JsonObjectGrammar | JsonSchemaGrammar | ToolsGrammar


class BoundedStr(Codec[str]):
    """A str of at most ``limit`` UTF-8 bytes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def encode(self, value: str) -> Any:
        return self.decode(value)

    def decode(self, obj: Any) -> str:
        if type(obj) is not str:
            raise PayloadError(f"expected str, got {type(obj).__name__}")
        if len(obj) > self.limit // 4 and len(obj.encode()) > self.limit:
            raise PayloadError(f"a text of more than {self.limit} bytes")
        return obj


_GRAMMAR_TEXT = BoundedStr(MAX_GRAMMAR_BYTES)
_FUNCTION_NAME = BoundedStr(256)


class GrammarCodec(Codec[Grammar]):
    """The grammar of a constraint: an enum (M11) of :data:`Grammar`'s three variants."""

    def encode(self, value: Grammar) -> Any:
        if isinstance(value, JsonObjectGrammar):
            return [0]
        if isinstance(value, JsonSchemaGrammar):
            return [1, _GRAMMAR_TEXT.encode(value.schema)]
        return [
            2,
            _GRAMMAR_TEXT.encode(value.tools),
            int(value.choice),
            _FUNCTION_NAME.encode(value.function),
            BOOL.encode(value.parallel),
        ]

    def decode(self, obj: Any) -> Grammar:
        if type(obj) is not list or not obj or type(obj[0]) is not int:
            raise PayloadError("expected a Grammar array")
        tag = obj[0]
        if tag == 0:
            return JsonObjectGrammar()
        if tag == 1 and len(obj) >= 2:
            return JsonSchemaGrammar(_GRAMMAR_TEXT.decode(obj[1]))
        if tag == 2 and len(obj) >= 5:
            choice = U8.decode(obj[2])
            if choice not in ToolChoice._value2member_map_:
                raise PayloadError(f"{choice} is not a ToolChoice")
            return ToolsGrammar(
                _GRAMMAR_TEXT.decode(obj[1]),
                ToolChoice(choice),
                _FUNCTION_NAME.decode(obj[3]),
                BOOL.decode(obj[4]),
            )
        raise PayloadError(f"bad Grammar {obj[:1]!r} of {len(obj)} elements")


class RangedF32(Codec[float]):
    """An f32 within ``[low, high]`` (NaN is refused)."""

    def __init__(self, low: float, high: float) -> None:
        self.low, self.high = low, high

    def encode(self, value: float) -> Any:
        return self.decode(value)

    def decode(self, obj: Any) -> float:
        value = FLOAT32.decode(obj)
        if not self.low <= value <= self.high:
            raise PayloadError(f"{value!r} is outside [{self.low:g}, {self.high:g}]")
        return value


LOGIT_BIAS_RANGE = (-100.0, 100.0)
"""What a logit bias may be (OpenAI's range)."""
PENALTY_RANGE = (-2.0, 2.0)
"""What ``presence_penalty`` and ``frequency_penalty`` may be (OpenAI's range)."""
REPETITION_RANGE = (0.0, 10.0)
"""What ``repetition_penalty`` may be; 0 and 1 leave the logits alone."""

_BIAS = RangedF32(*LOGIT_BIAS_RANGE)
_PENALTY = RangedF32(*PENALTY_RANGE)
_REPETITION = RangedF32(*REPETITION_RANGE)


class UIntUpTo(UInt):
    """A u32 of at most ``maximum``."""

    def __init__(self, maximum: int) -> None:
        super().__init__(32)
        self.limit = maximum + 1


class LogitBiasCodec(Codec[tuple[tuple[int, float], ...]]):
    """``[[token u32, bias f32], ...]``, at most :data:`MAX_LOGIT_BIAS` pairs."""

    def encode(self, value: tuple[tuple[int, float], ...]) -> Any:
        if len(value) > MAX_LOGIT_BIAS:
            raise PayloadError(f"more than {MAX_LOGIT_BIAS} logit_bias entries")
        return [[U32.encode(t), _BIAS.encode(b)] for t, b in value]

    def decode(self, obj: Any) -> tuple[tuple[int, float], ...]:
        if type(obj) is not list or len(obj) > MAX_LOGIT_BIAS:
            raise PayloadError(f"logit_bias: an array of at most {MAX_LOGIT_BIAS} pairs")
        pairs = []
        for pair in obj:
            if type(pair) is not list or len(pair) < 2:
                raise PayloadError("logit_bias: an entry is a [token, bias] pair")
            pairs.append((U32.decode(pair[0]), _BIAS.decode(pair[1])))
        return tuple(pairs)


@dataclass(frozen=True, slots=True)
class SamplerControls(Struct):
    """The sampler's per-lane controls (docs/engine.md section 2.4); all zero leaves the
    logits alone."""

    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to those tokens' logits."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token the generation has produced."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time the generation has produced it."""
    repetition_penalty: float = 0.0
    """llama.cpp's: the logits of the tokens in the window are divided by it (multiplied when
    not positive); 0 and 1 leave them alone."""
    repetition_window: int = 64
    """How many of the context's last tokens ``repetition_penalty`` looks at."""
    FIELDS = (LogitBiasCodec(), _PENALTY, _PENALTY, _REPETITION, UIntUpTo(MAX_REPETITION_WINDOW))

    @property
    def penalises(self) -> bool:
        """Whether any penalty changes logits."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or (self.repetition_penalty not in (0.0, 1.0) and self.repetition_window)
        )

    @property
    def empty(self) -> bool:
        """Whether these controls change nothing."""
        return not (self.logit_bias or self.penalises)


@dataclass(frozen=True, slots=True)
class Constraint(Struct):
    """The optional eighth element of GENERATE_REQ (docs/protocol.md section 12.3), sent only
    to a node that set FEATURE_CONSTRAINTS.

    ``generated_from`` is the index in the session's context where the generation's own
    output starts: tokens from there on were generated under this constraint before a
    failover, and the node replays them through its grammar and counts them for the
    penalties before it draws the next token.
    """

    generated_from: int
    grammar: Grammar | None = None
    controls: SamplerControls | None = None
    FIELDS = (U64, Optional(GrammarCodec()), Optional(SamplerControls.as_codec()))


class RequestClass(enum.IntEnum):
    """Who waits on a generation (docs/protocol.md section 12.2).  The numbers are the wire's."""

    INTERACTIVE = 0
    """A person is waiting: admitted ahead of batch work.  What a GENERATE_REQ without the
    element means."""
    BATCH = 1
    """Throughput work (agents, evaluations, bulk jobs): never ahead of interactive work."""


@dataclass(frozen=True, slots=True)
class GenerateReqMsg(Message):
    """GENERATE_REQ.  ``request_class`` is the optional seventh element of section 12.2: None
    (not written, the six-element message every node reads) or a u8, where 0 is interactive,
    1 batch, and any other value reads as batch.  ``constraint`` is the optional eighth of
    section 12.3; with one, the seventh is written too (``nil`` when there is no class)."""

    command_id: int
    session_id: int
    epoch: int
    generation_id: int
    budgets: GenerationBudgetsMsg
    policy_ref: int = 0
    request_class: int | None = None
    constraint: Constraint | None = None
    """The optional eighth element of section 12.3 (None: not written)."""
    MSG_TYPE = MsgType.GENERATE_REQ
    FIELDS = (
        U64,
        U64,
        U64,
        U64,
        GenerationBudgetsMsg.as_codec(),
        U64,
        Optional(U8),
        Optional(Constraint.as_codec()),
    )

    def __post_init__(self) -> None:
        if isinstance(self.request_class, RequestClass):
            # Compared and encoded as the plain u8 it is on the wire.
            object.__setattr__(self, "request_class", int(self.request_class))

    @property
    def interactive(self) -> bool:
        """Whether the generation is interactive: class 0, or no class at all (an older head
        classifies nothing, and its requests keep every lane as they always did)."""
        return self.request_class is None or self.request_class == RequestClass.INTERACTIVE

    def to_wire(self) -> list[Any]:
        wire = Struct.to_wire(self)
        if self.constraint is not None:
            return wire
        return wire[:7] if self.request_class is not None else wire[:6]

    @classmethod
    def from_wire(cls, obj: Any) -> GenerateReqMsg:
        if type(obj) is list and 6 <= len(obj) < 8:
            obj = [*obj, *[None] * (8 - len(obj))]
        message: GenerateReqMsg = super(GenerateReqMsg, cls).from_wire(obj)
        return message


@dataclass(frozen=True, slots=True)
class ParkReqMsg(Message):
    command_id: int
    session_id: int
    epoch: int
    generation_id: int
    MSG_TYPE = MsgType.PARK_REQ
    FIELDS = (U64, U64, U64, U64)


@dataclass(frozen=True, slots=True)
class ResumeReqMsg(Message):
    command_id: int
    session_id: int
    epoch: int
    generation_id: int
    budgets: GenerationBudgetsMsg
    policy_ref: int
    MSG_TYPE = MsgType.RESUME_REQ
    FIELDS = (U64, U64, U64, U64, GenerationBudgetsMsg.as_codec(), U64)


@dataclass(frozen=True, slots=True)
class GenerateCancelMsg(Message):
    session_id: int
    generation_id: int
    MSG_TYPE = MsgType.GENERATE_CANCEL
    FIELDS = (U64, U64)


_EVENT_PAYLOAD = TokenEventPayloadCodec()


@dataclass(slots=True)
class TokenEventsMsg(Message):
    """The node's token events.  The hot path of Link F: its codec is written out by hand,
    with the same checks the generic codec makes."""

    events: tuple[TokenEvent, ...]
    MSG_TYPE = MsgType.TOKEN_EVENTS
    FIELDS = (ArrayOf(TokenEvent.as_codec()),)

    def to_wire(self) -> list[Any]:
        encode_payload = _EVENT_PAYLOAD.encode
        out = []
        for e in self.events:
            s, ep, g, q, p = e.session_id, e.epoch, e.generation_id, e.event_seq, e.payload
            if not (
                type(s) is int
                and type(ep) is int
                and type(g) is int
                and type(q) is int
                and s >= 0
                and ep >= 0
                and g >= 0
                and q >= 0
                and (s | ep | g | q) <= U64_MAX
            ):
                raise PayloadError(f"TokenEvent ids {(s, ep, g, q)!r} do not fit u64")
            if type(p) is Tokens:
                # array("I") refuses floats, strings, negatives and values past u32 in C;
                # receivers do the full check.
                try:
                    array("I", p.tokens)
                except (OverflowError, TypeError) as error:
                    raise PayloadError(f"Tokens {p.tokens!r} do not fit u32: {error}") from error
                out.append([s, ep, g, q, [0, p.tokens]])
            else:
                out.append([s, ep, g, q, encode_payload(p)])
        return [out]

    @classmethod
    def from_wire(cls, obj: Any) -> TokenEventsMsg:
        return cls._decode(obj, bools_possible=True)

    @classmethod
    def from_payload(cls, payload: bytes) -> TokenEventsMsg:
        """Decode straight from the bytes: a payload with no msgpack true/false byte (c2, c3)
        holds no bool, so token arrays skip the bool check that :meth:`from_wire` needs."""
        return cls._decode(unpack(payload), 0xC2 in payload or 0xC3 in payload)

    @classmethod
    def _decode(cls, obj: Any, bools_possible: bool) -> TokenEventsMsg:
        if type(obj) is not list or not obj or type(obj[0]) is not list:
            raise PayloadError("TokenEventsMsg: expected [[event, ...]]")
        decode_payload = _EVENT_PAYLOAD.decode
        events = []
        for e in obj[0]:
            if type(e) is not list or len(e) < 5:
                raise PayloadError("TokenEvent: expected an array of 5 fields")
            s = e[0]
            ep = e[1]
            g = e[2]
            q = e[3]
            p = e[4]
            if not (
                type(s) is int
                and type(ep) is int
                and type(g) is int
                and type(q) is int
                and s >= 0
                and ep >= 0
                and g >= 0
                and q >= 0
            ):
                # msgpack holds no integer above u64, so non-negative ints are all in range.
                raise PayloadError(f"TokenEvent: ids {(s, ep, g, q)!r} are not all u64")
            # The common case, Tokens, is decoded inline; the codec does the rest.
            if type(p) is list and len(p) >= 2 and p[0] == 0 and type(p[0]) is int:
                tokens = p[1]
                if type(tokens) is not list:
                    raise PayloadError("Tokens: expected an array")
                if bools_possible:
                    U32Array.check(tokens)
                else:
                    try:
                        array("I", tokens)
                    except (OverflowError, TypeError):
                        U32Array.check(tokens)
                payload: TokenEventPayload = Tokens(tuple(tokens))
            else:
                payload = decode_payload(p)
            events.append(TokenEvent(s, ep, g, q, payload))
        return cls(tuple(events))


@dataclass(frozen=True, slots=True)
class WatermarkAckMsg(Message):
    session_id: int
    epoch: int
    generation_id: int
    watermark: int
    MSG_TYPE = MsgType.WATERMARK_ACK
    FIELDS = (U64, U64, U64, U64)


@dataclass(frozen=True, slots=True)
class XferBeginMsg(Message):
    transfer_id: int
    total_len: int
    checksum: int
    content_type: int
    content_hash: bytes
    MSG_TYPE = MsgType.XFER_BEGIN
    FIELDS = (U64, U64, U64, U32, HASH32)


@dataclass(frozen=True, slots=True)
class XferChunkMsg(Message):
    transfer_id: int
    offset: int
    data: bytes
    MSG_TYPE = MsgType.XFER_CHUNK
    FIELDS = (U64, U64, BIN)


@dataclass(frozen=True, slots=True)
class XferEndMsg(Message):
    transfer_id: int
    MSG_TYPE = MsgType.XFER_END
    FIELDS = (U64,)


@dataclass(frozen=True, slots=True)
class XferAbortMsg(Message):
    transfer_id: int
    reason: int
    MSG_TYPE = MsgType.XFER_ABORT
    FIELDS = (U64, U32)


@dataclass(frozen=True, slots=True)
class StateShipMsg(Message):
    envelope: bytes
    transfer_id: int
    MSG_TYPE = MsgType.STATE_SHIP
    FIELDS = (BIN, U64)


@dataclass(frozen=True, slots=True)
class StateFetchMsg(Message):
    envelope: bytes
    transfer_id: int
    MSG_TYPE = MsgType.STATE_FETCH
    FIELDS = (BIN, U64)


@dataclass(frozen=True, slots=True)
class BlobFetchMsg(Message):
    content_hash: bytes
    MSG_TYPE = MsgType.BLOB_FETCH
    FIELDS = (HASH32,)


@dataclass(frozen=True, slots=True)
class NodeStatusMsg(Message):
    capacity: CapacitySummary
    loadable_models: tuple[str, ...]
    mem: MemCountersMsg
    MSG_TYPE = MsgType.NODE_STATUS
    FIELDS = (CapacitySummary.as_codec(), ArrayOf(STR), MemCountersMsg.as_codec())


@dataclass(frozen=True, slots=True)
class StageForwardReqMsg(Message):
    """STAGE_FORWARD_REQ (docs/protocol.md section 7.6).  ``stage_session`` and ``position``
    are the optional sixth and seventh elements of section 12.8 (None: not written, the
    stateless five-element message every node reads); both are written or neither."""

    request_id: int
    tokens: tuple[int, ...]
    start_layer: int
    end_layer: int
    hidden_in: bytes | None
    stage_session: int | None = None
    position: int | None = None
    MSG_TYPE = MsgType.STAGE_FORWARD_REQ
    FIELDS = (U64, U32S, U32, U32, Optional(BIN), Optional(U64), Optional(U64))

    def __post_init__(self) -> None:
        # One value per meaning: stateless has no position; a session's position is a number.
        if self.stage_session is None:
            object.__setattr__(self, "position", None)
        elif self.position is None:
            object.__setattr__(self, "position", 0)

    def to_wire(self) -> list[Any]:
        wire = Struct.to_wire(self)
        return wire if self.stage_session is not None else wire[:5]

    @classmethod
    def from_wire(cls, obj: Any) -> StageForwardReqMsg:
        if type(obj) is list and len(obj) == 5:
            obj = [*obj, None, None]
        if type(obj) is list and len(obj) >= 7 and (obj[5] is None) != (obj[6] is None):
            raise PayloadError("STAGE_FORWARD_REQ: stage_session and position go together")
        message: StageForwardReqMsg = super(StageForwardReqMsg, cls).from_wire(obj)
        return message

    @property
    def kept(self) -> bool:
        """Whether the request runs against a stage session's kept KV (section 12.8)."""
        return self.stage_session is not None


@dataclass(frozen=True, slots=True)
class StageForwardRespMsg(Message):
    request_id: int
    hidden: bytes | None
    token: int | None
    MSG_TYPE = MsgType.STAGE_FORWARD_RESP
    FIELDS = (U64, Optional(BIN), Optional(U32))


@dataclass(frozen=True, slots=True)
class StageReleaseMsg(Message):
    """STAGE_RELEASE (docs/protocol.md section 12.8): the node forgets that stage session of
    the connection; silent."""

    stage_session: int
    MSG_TYPE = MsgType.STAGE_RELEASE
    FIELDS = (U64,)


@dataclass(frozen=True, slots=True)
class StageBatchRow(Struct):
    """One stage session's rows in a STAGE_BATCH_REQ (docs/protocol.md section 12.8): what a
    kept STAGE_FORWARD_REQ carries for it, without the layer range the batch shares."""

    stage_session: int
    position: int
    tokens: tuple[int, ...]
    hidden_in: bytes | None
    FIELDS = (U64, U64, U32S, Optional(BIN))


@dataclass(frozen=True, slots=True)
class StageBatchAnswer(Struct):
    """One row's answer in a STAGE_BATCH_RESP: as a STAGE_FORWARD_RESP's ``hidden`` and
    ``token`` (both nil: that row was refused and its session dropped)."""

    hidden: bytes | None
    token: int | None
    FIELDS = (Optional(BIN), Optional(U32))


def _check_sessions(name: str, sessions: Sequence[int]) -> None:
    """A frame of stage rows (sections 12.8 and 12.10) carries at least one, each of its own
    stage session."""
    if not sessions:
        raise PayloadError(f"{name}: a frame carries at least one row")
    if len(set(sessions)) != len(sessions):
        raise PayloadError(f"{name}: a stage session appears twice")


@dataclass(frozen=True, slots=True)
class StageBatchReqMsg(Message):
    """STAGE_BATCH_REQ (docs/protocol.md section 12.8, only to a node with
    :data:`FEATURE_STAGE_BATCH`): the rows of several stage sessions through one layer range,
    answered by one STAGE_BATCH_RESP of the same ``request_id``, one answer per row in order."""

    request_id: int
    start_layer: int
    end_layer: int
    rows: tuple[StageBatchRow, ...]
    MSG_TYPE = MsgType.STAGE_BATCH_REQ
    FIELDS = (U64, U32, U32, ArrayOf(StageBatchRow.as_codec()))

    @classmethod
    def from_wire(cls, obj: Any) -> StageBatchReqMsg:
        message: StageBatchReqMsg = super(StageBatchReqMsg, cls).from_wire(obj)
        _check_sessions("STAGE_BATCH_REQ", [row.stage_session for row in message.rows])
        return message


@dataclass(frozen=True, slots=True)
class StageBatchRespMsg(Message):
    """STAGE_BATCH_RESP: the answer of each row of the STAGE_BATCH_REQ of ``request_id``, in
    the request's order."""

    request_id: int
    answers: tuple[StageBatchAnswer, ...]
    MSG_TYPE = MsgType.STAGE_BATCH_RESP
    FIELDS = (U64, ArrayOf(StageBatchAnswer.as_codec()))


RING_ENDPOINT_CHARS = 512
"""The longest ``next`` endpoint a STAGE_RING_JOIN may name (it fits the 1 KiB payload)."""


@dataclass(frozen=True, slots=True)
class StageRingJoinMsg(Message):
    """STAGE_RING_JOIN (docs/protocol.md section 12.10, only to a node with
    :data:`FEATURE_STAGE_RING`): rows of ``ring`` that the node computes in ``[start_layer,
    end_layer)`` go to the node at endpoint ``next``; the ring is the sending connection's."""

    ring: int
    start_layer: int
    end_layer: int
    next: str
    MSG_TYPE = MsgType.STAGE_RING_JOIN
    FIELDS = (U64, U32, U32, STR)

    @classmethod
    def from_wire(cls, obj: Any) -> StageRingJoinMsg:
        message: StageRingJoinMsg = super(StageRingJoinMsg, cls).from_wire(obj)
        if not 0 < len(message.next) <= RING_ENDPOINT_CHARS:
            raise PayloadError(
                f"STAGE_RING_JOIN: the next endpoint takes 1 to {RING_ENDPOINT_CHARS} characters"
            )
        if message.start_layer >= message.end_layer:
            raise PayloadError("STAGE_RING_JOIN: a ring stage runs at least one layer")
        return message


@dataclass(frozen=True, slots=True)
class StageRingRow(Struct):
    """One stage session's rows in a STAGE_RING_ROWS (docs/protocol.md section 12.10): a
    STAGE_BATCH_REQ row, and the tokens the ring still makes for it (``left``, counting the one
    this row leads to) and the token ids that end it (``stop``)."""

    stage_session: int
    position: int
    tokens: tuple[int, ...]
    hidden_in: bytes | None
    left: int
    stop: tuple[int, ...]
    FIELDS = (U64, U64, U32S, Optional(BIN), U32, U32S)


@dataclass(frozen=True, slots=True)
class StageRingRowsMsg(Message):
    """STAGE_RING_ROWS (docs/protocol.md section 12.10): rows of ``ring`` for the receiving
    stage, from the head (the first step) or the previous stage; forwarded, never answered."""

    ring: int
    rows: tuple[StageRingRow, ...]
    MSG_TYPE = MsgType.STAGE_RING_ROWS
    FIELDS = (U64, ArrayOf(StageRingRow.as_codec()))

    @classmethod
    def from_wire(cls, obj: Any) -> StageRingRowsMsg:
        message: StageRingRowsMsg = super(StageRingRowsMsg, cls).from_wire(obj)
        _check_sessions("STAGE_RING_ROWS", [row.stage_session for row in message.rows])
        if any(row.left < 1 for row in message.rows):
            raise PayloadError("STAGE_RING_ROWS: a row leads to at least one token (left >= 1)")
        return message


@dataclass(frozen=True, slots=True)
class StageRingToken(Struct):
    """One token of a STAGE_RING_TOKENS: the token after the row of ``stage_session`` that
    ended at ``position`` (the token's own position), or None: that row was refused or lost."""

    stage_session: int
    position: int
    token: int | None
    FIELDS = (U64, U64, Optional(U32))


@dataclass(frozen=True, slots=True)
class StageRingTokensMsg(Message):
    """STAGE_RING_TOKENS (docs/protocol.md section 12.10, node to head): tokens of ``ring``'s
    generations, and the rows it refused or lost."""

    ring: int
    tokens: tuple[StageRingToken, ...]
    MSG_TYPE = MsgType.STAGE_RING_TOKENS
    FIELDS = (U64, ArrayOf(StageRingToken.as_codec()))

    @classmethod
    def from_wire(cls, obj: Any) -> StageRingTokensMsg:
        message: StageRingTokensMsg = super(StageRingTokensMsg, cls).from_wire(obj)
        if not message.tokens:
            raise PayloadError("STAGE_RING_TOKENS: a frame carries at least one token")
        return message


@dataclass(frozen=True, slots=True)
class EmbedReqMsg(Message):
    """EMBED_REQ (docs/protocol.md section 12.7): the texts to embed, answered by one
    EMBED_RESP of the same ``request_id``."""

    request_id: int
    texts: tuple[str, ...]
    MSG_TYPE = MsgType.EMBED_REQ
    FIELDS = (U64, ArrayOf(STR))


@dataclass(frozen=True, slots=True)
class EmbedRespMsg(Message):
    """EMBED_RESP: one vector of ``dim`` little-endian f32 per text, row-major, and the tokens
    the texts took; ``vectors`` None: refused (no embedding model, or it failed)."""

    request_id: int
    vectors: bytes | None
    dim: int
    tokens: int
    MSG_TYPE = MsgType.EMBED_RESP
    FIELDS = (U64, Optional(BIN), U32, U64)


@dataclass(frozen=True, slots=True)
class TelemetryMsg(Message):
    spans: bytes
    MSG_TYPE = MsgType.TELEMETRY
    FIELDS = (BIN,)


@dataclass(frozen=True, slots=True)
class Keepalive(Message):
    """``()``: encoded as msgpack nil; its payload is never decoded (M12)."""

    MSG_TYPE = MsgType.KEEPALIVE
    FIELDS = ()

    def payload(self) -> bytes:
        return b"\xc0"

    @classmethod
    def from_wire(cls, obj: Any) -> Keepalive:
        return cls()


MESSAGE_CLASSES: dict[MsgType, type[Message]] = {
    cls.MSG_TYPE: cls
    for cls in (
        Hello, HelloAckF, ReconcileMsg, ReconcileAckMsg, SessionAssignMsg, SessionRevokeMsg,
        PolicyUpdateMsg, LeaseRenewMsg, LeaseGrantMsg, AppendContentMsg, GenerateReqMsg,
        ParkReqMsg, ResumeReqMsg, TokenEventsMsg, WatermarkAckMsg, XferBeginMsg, XferChunkMsg,
        XferEndMsg, XferAbortMsg, StateShipMsg, StateFetchMsg, BlobFetchMsg, NodeStatusMsg,
        GenerateCancelMsg, StageForwardReqMsg, StageForwardRespMsg, EmbedReqMsg, EmbedRespMsg,
        StageReleaseMsg, StageBatchReqMsg, StageBatchRespMsg, StageRingJoinMsg,
        StageRingRowsMsg, StageRingTokensMsg, TelemetryMsg, Keepalive,
    )
}  # fmt: skip


_CLASS_BY_NUMBER: dict[int, type[Message]] = {int(t): c for t, c in MESSAGE_CLASSES.items()}
_ENVELOPE_OF_CLASS: dict[type[Message], tuple[int, int]] = {
    c: (int(t), frame_class(t)) for t, c in MESSAGE_CLASSES.items()
}
"""Each message class's type number and class byte, looked up once per frame sent."""
_LIMIT_OF_CLASS: dict[type[Message], int] = {
    c: PAYLOAD_LIMITS[int(t)] for t, c in MESSAGE_CLASSES.items()
}


def decode_message(msg_type: int, payload: bytes) -> Message:
    """The typed message of a frame's payload; :class:`PayloadError` when it is malformed."""
    cls = _CLASS_BY_NUMBER.get(msg_type)
    if cls is None:
        raise UnknownRequiredType(f"unknown message type 0x{msg_type:04x}")
    if cls is Keepalive:
        return Keepalive()
    if cls is TokenEventsMsg:
        return TokenEventsMsg.from_payload(payload)
    return cls.from_wire(unpack(payload))


def decode_frame(frame: Frame) -> Message:
    """The typed message of a decoded frame (:func:`decode_message`)."""
    return decode_message(frame[0], frame[2])


def message_frame(message: Message, seq: int) -> bytes:
    """The whole frame of one message (:func:`encode_frame` with the class its type implies)."""
    msg_type, cls = _ENVELOPE_OF_CLASS[type(message)]
    payload = message.payload()
    length = HEADER_LEN + len(payload)
    if length > MAX_FRAME:
        raise FrameTooLarge(f"frame of {length} bytes exceeds MAX_FRAME {MAX_FRAME}")
    if len(payload) > _LIMIT_OF_CLASS[type(message)]:
        _check_payload_limit(msg_type, len(payload))
    return _ENVELOPE.pack(length, PROTO_VERSION, msg_type, seq, 0, cls) + payload


# --------------------------------------------------------------------------------------------
# Nested blobs (docs/protocol.md section 3.4)


@dataclass(frozen=True, slots=True)
class GenParams(Struct):
    """Sampling parameters; all zero means greedy (docs/engine.md section 2).

    ``logprobs`` (docs/protocol.md section 12.1) is the sixth element, written only when it
    is not 0, so the blob of a generation that asks for none is the five-element blob every
    node reads; a five-element blob, or a sixth element that is no u8, reads as 0.
    """

    temperature: float = 0.0
    top_p: float = 0.0
    min_p: float = 0.0
    top_k: int = 0
    seed: int = 0
    logprobs: int = 0
    """0: none; n from 1 to LOGPROBS_MAX: each token's logprob and its n - 1 most likely
    alternatives (TokensLogprobs events; only on a node with FEATURE_LOGPROBS).  A node
    reads a larger value as LOGPROBS_MAX."""
    FIELDS = (FLOAT32, FLOAT32, FLOAT32, U32, U64, U8)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def to_wire(self) -> list[Any]:
        wire = Struct.to_wire(self)
        return wire if self.logprobs else wire[:5]

    @classmethod
    def from_wire(cls, obj: Any) -> GenParams:
        if type(obj) is list and len(obj) >= 5:
            sixth = obj[5] if len(obj) > 5 else 0
            if type(sixth) is not int or not 0 <= sixth <= 0xFF:
                sixth = 0  # not a logprobs count: some other appended field, read as none
            obj = [*obj[:5], sixth]
        params: GenParams = super(GenParams, cls).from_wire(obj)
        return params


def encode_params(params: GenParams) -> bytes:
    """The ``SessionAssignMsg.params`` blob."""
    return pack(params.to_wire())


def decode_params(blob: bytes) -> GenParams:
    """Lenient: empty bytes or anything malformed is the all-zero default (docs/protocol.md section
    3.4)."""
    if not blob:
        return GenParams()
    try:
        return GenParams.from_wire(unpack(blob))
    except PayloadError:
        return GenParams()


def encode_tokens(tokens: Sequence[int]) -> bytes:
    """The ``AppendContentMsg.blocks`` blob: the session's complete token context."""
    return pack(U32S.encode(tuple(tokens)))


def decode_tokens(blob: bytes) -> tuple[int, ...]:
    """Strict: a malformed context is a :class:`PayloadError` (fatal to the connection)."""
    return U32S.decode(unpack(blob))


def negotiate(offered: tuple[int, int], supported: tuple[int, int]) -> int | None:
    """The highest version both ranges contain, or None (docs/protocol.md section 5.2)."""
    lo = max(offered[0], supported[0])
    hi = min(offered[1], supported[1])
    return hi if lo <= hi else None
