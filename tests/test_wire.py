"""Tests of sfnode.linkf.wire: golden byte vectors, the streaming decoder, payload strictness,
catalog.

They pin docs/protocol.md sections 2 to 4 (the envelope, the msgpack payload rules and the catalog)
and section 10, items 1 and 2; property tests check that every one of the 28 message types
round-trips and that no bytes a peer can send make the decoder raise anything but a ``WireError``.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from sfnode.linkf import wire
from sfnode.linkf.wire import (
    F32,
    HEADER_LEN,
    MAX_FRAME,
    MAX_PAYLOAD,
    MESSAGE_CLASSES,
    U32_MAX,
    U64_MAX,
    ArrayOf,
    BadLength,
    BlobFetchMsg,
    Bool,
    ClassRangeMismatch,
    Codec,
    Finish,
    Frame,
    FrameDecoder,
    FrameTooLarge,
    GenParams,
    Hello,
    Keepalive,
    LinkRole,
    Message,
    MsgType,
    Optional,
    Pair,
    PayloadError,
    Segment,
    SegmentKind,
    Str,
    StructCodec,
    TokenEvent,
    TokenEventPayloadCodec,
    TokenEventsMsg,
    Tokens,
    Truncated,
    U32Array,
    UInt,
    UnitEnum,
    UnknownRequiredType,
    Usage,
    UsageMsg,
    WatermarkAckMsg,
    WireError,
    decode_frame,
    decode_message,
    decode_params,
    decode_tokens,
    encode_frame,
    encode_params,
    encode_tokens,
    message_frame,
    negotiate,
)

WATERMARK_ACK_FRAME = bytes.fromhex(
    "1a000000 0200 0f00 0100000000000000 0000000000000000 00 9401056403".replace(" ", "")
)
HELLO_FRAME = bytes.fromhex(
    "1d000000 0200 0100 0100000000000000 0000000000000000 00 939202029102c400".replace(" ", "")
)
KEEPALIVE_FRAME = bytes.fromhex(
    "16000000 0200 0280 0700000000000000 0000000000000000 01 c0".replace(" ", "")
)
TOKEN_EVENTS_PAYLOAD = bytes.fromhex("91 92 95 01 05 64 00 92 00 92 07 08 95 01 05 64 01 92 03 02")
GEN_PARAMS_BLOB = bytes.fromhex("95 ca00000000 ca3f800000 ca00000000 00 2a")
TOKENS_BLOB = bytes.fromhex("93 cd012c cd012d cd012e")

WATERMARK_ACK = WatermarkAckMsg(session_id=1, epoch=5, generation_id=100, watermark=3)
HELLO = Hello(proto_versions=(2, 2), link_role=LinkRole.HEAD_DAEMON, auth=b"")
TOKEN_EVENTS = TokenEventsMsg(
    events=(
        TokenEvent(1, 5, 100, 0, Tokens((7, 8))),
        TokenEvent(1, 5, 100, 1, Finish(2)),
    )
)

PROPERTY_SETTINGS = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
PER_TYPE_SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def raw_frame(msg_type: int, payload: bytes = b"", cls: int | None = None, seq: int = 1) -> bytes:
    """A frame built by hand, with any class byte (encode_frame would refuse a wrong one)."""
    if cls is None:
        cls = wire.frame_class(msg_type)
    return struct.pack("<IHHQQB", HEADER_LEN + len(payload), 2, msg_type, seq, 0, cls) + payload


def raw_pack(obj: Any) -> bytes:
    """msgpack with full-width floats and ``bytes`` as bin: what a foreign peer might send."""
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


# --------------------------------------------------------------------------------------------
# Golden vectors (docs/protocol.md sections 2.5 and 3.4)


class GoldenVectorTests(SynchronousTestCase):
    def test_watermark_ack_encodes(self) -> None:
        """WATERMARK_ACK{1, 5, 100, 3} at seq 1 encodes to the bytes of docs/protocol.md section
        2.5."""
        self.assertEqual(message_frame(WATERMARK_ACK, 1), WATERMARK_ACK_FRAME)

    def test_watermark_ack_decodes(self) -> None:
        """The WATERMARK_ACK bytes of docs/protocol.md section 2.5 decode to the message."""
        (frame,) = FrameDecoder().feed(WATERMARK_ACK_FRAME)
        self.assertEqual(frame, Frame(MsgType.WATERMARK_ACK, 1, bytes.fromhex("9401056403")))
        self.assertEqual(decode_frame(frame), WATERMARK_ACK)

    def test_hello_encodes(self) -> None:
        """HELLO{(2,2), HeadDaemon, b""} at seq 1 encodes to the bytes of docs/protocol.md section
        2.5."""
        self.assertEqual(message_frame(HELLO, 1), HELLO_FRAME)

    def test_hello_decodes(self) -> None:
        """The HELLO bytes of docs/protocol.md section 2.5 decode to the message."""
        (frame,) = FrameDecoder().feed(HELLO_FRAME)
        self.assertEqual(decode_frame(frame), HELLO)
        self.assertIs(decode_frame(frame).link_role, LinkRole.HEAD_DAEMON)  # type: ignore[attr-defined]

    def test_keepalive_encodes(self) -> None:
        """KEEPALIVE at seq 7 is a droppable frame whose payload is msgpack nil (docs/protocol.md
        section 2.5)."""
        self.assertEqual(message_frame(Keepalive(), 7), KEEPALIVE_FRAME)

    def test_keepalive_decodes(self) -> None:
        """The KEEPALIVE bytes of docs/protocol.md section 2.5 are delivered as a frame and decode
        to Keepalive."""
        (frame,) = FrameDecoder().feed(KEEPALIVE_FRAME)
        self.assertEqual(frame, Frame(MsgType.KEEPALIVE, 7, b"\xc0"))
        self.assertEqual(decode_frame(frame), Keepalive())

    def test_keepalive_payload_never_decoded(self) -> None:
        """Any KEEPALIVE payload is accepted, including empty bytes and garbage (M12)."""
        for payload in (b"", b"\xc1", b"\x91\x92", b"\x00" * 10):
            self.assertEqual(decode_message(MsgType.KEEPALIVE, payload), Keepalive())

    def test_token_events_encodes(self) -> None:
        """TOKEN_EVENTS [Tokens([7,8]) seq 0, Finish{2} seq 1] has the payload of docs/protocol.md
        section 2.5."""
        self.assertEqual(TOKEN_EVENTS.payload(), TOKEN_EVENTS_PAYLOAD)

    def test_token_events_decodes(self) -> None:
        """The TOKEN_EVENTS payload of docs/protocol.md section 2.5 decodes to the two events."""
        self.assertEqual(decode_message(MsgType.TOKEN_EVENTS, TOKEN_EVENTS_PAYLOAD), TOKEN_EVENTS)

    def test_gen_params_blob(self) -> None:
        """GenParams [0.0, 1.0, 0.0, 0, 42] is the float32 blob of docs/protocol.md section 3.4,
        both ways."""
        params = GenParams(temperature=0.0, top_p=1.0, min_p=0.0, top_k=0, seed=42)
        self.assertEqual(encode_params(params), GEN_PARAMS_BLOB)
        self.assertEqual(decode_params(GEN_PARAMS_BLOB), params)

    def test_tokens_blob(self) -> None:
        """The context [300, 301, 302] is the blob of docs/protocol.md section 3.4, both ways."""
        self.assertEqual(encode_tokens([300, 301, 302]), TOKENS_BLOB)
        self.assertEqual(decode_tokens(TOKENS_BLOB), (300, 301, 302))


# --------------------------------------------------------------------------------------------
# The streaming decoder (docs/protocol.md section 2.4)


class FrameDecoderTests(SynchronousTestCase):
    def test_bad_length_on_four_bytes(self) -> None:
        """len < 21 raises BadLength as soon as the 4 length bytes are buffered."""
        decoder = FrameDecoder()
        self.assertEqual(decoder.feed(b"\x14\x00"), [])
        self.assertRaises(BadLength, decoder.feed, b"\x00\x00")

    def test_bad_length_zero(self) -> None:
        """len 0 is BadLength too."""
        self.assertRaises(BadLength, FrameDecoder().feed, b"\x00\x00\x00\x00")

    def test_frame_too_large_on_four_bytes(self) -> None:
        """len > MAX_FRAME raises FrameTooLarge as soon as the 4 length bytes are buffered."""
        self.assertRaises(FrameTooLarge, FrameDecoder().feed, struct.pack("<I", MAX_FRAME + 1))
        self.assertRaises(FrameTooLarge, FrameDecoder().feed, b"\xff\xff\xff\xff")

    def test_max_frame_waits(self) -> None:
        """len == MAX_FRAME is legal: the decoder waits for the body."""
        decoder = FrameDecoder()
        self.assertEqual(decoder.feed(struct.pack("<I", MAX_FRAME) + b"\x02\x00"), [])
        self.assertEqual(decoder.buffered, 6)

    def test_header_only_frame(self) -> None:
        """len == 21 (an empty payload) is a whole frame."""
        (frame,) = FrameDecoder().feed(raw_frame(MsgType.XFER_END))
        self.assertEqual(frame, Frame(MsgType.XFER_END, 1, b""))

    def test_class_byte_two(self) -> None:
        """A class byte of 2 is ClassRangeMismatch, for a required and a droppable type."""
        self.assertRaises(
            ClassRangeMismatch, FrameDecoder().feed, raw_frame(MsgType.WATERMARK_ACK, cls=2)
        )
        self.assertRaises(
            ClassRangeMismatch, FrameDecoder().feed, raw_frame(MsgType.KEEPALIVE, b"\xc0", cls=2)
        )

    def test_mismatched_class(self) -> None:
        """A required type with class 1, or a droppable one with class 0, is ClassRangeMismatch."""
        self.assertRaises(ClassRangeMismatch, FrameDecoder().feed, raw_frame(MsgType.HELLO, cls=1))
        self.assertRaises(
            ClassRangeMismatch, FrameDecoder().feed, raw_frame(MsgType.KEEPALIVE, cls=0)
        )

    def test_class_checked_before_type(self) -> None:
        """An unknown droppable type with class 0 is a ClassRangeMismatch, not skipped."""
        self.assertRaises(ClassRangeMismatch, FrameDecoder().feed, raw_frame(0x8003, cls=0))

    def test_unknown_required_type(self) -> None:
        """A required-range type outside the catalog fails closed with UnknownRequiredType."""
        self.assertRaises(UnknownRequiredType, FrameDecoder().feed, raw_frame(0x00FF))
        self.assertRaises(UnknownRequiredType, FrameDecoder().feed, raw_frame(0x0023))
        self.assertRaises(UnknownRequiredType, FrameDecoder().feed, raw_frame(0x0000))

    def test_unknown_droppable_skipped(self) -> None:
        """An unknown droppable type is skipped silently and the next frame is delivered."""
        decoder = FrameDecoder()
        frames = decoder.feed(raw_frame(0x8003, b"junk") + raw_frame(0xFFFF) + WATERMARK_ACK_FRAME)
        self.assertEqual([f.msg_type for f in frames], [MsgType.WATERMARK_ACK])
        self.assertEqual(decoder.buffered, 0)

    def test_truncated_on_finish(self) -> None:
        """finish() with part of a frame buffered raises Truncated; with nothing it is silent."""
        decoder = FrameDecoder()
        decoder.feed(WATERMARK_ACK_FRAME[:-1])
        self.assertRaises(Truncated, decoder.finish)
        decoder = FrameDecoder()
        decoder.feed(WATERMARK_ACK_FRAME[:2])
        self.assertRaises(Truncated, decoder.finish)
        decoder = FrameDecoder()
        decoder.feed(WATERMARK_ACK_FRAME)
        decoder.finish()

    def test_byte_by_byte(self) -> None:
        """A frame split across many feeds, one byte each, comes out once, at the last byte."""
        decoder = FrameDecoder()
        delivered: list[Frame] = []
        for i, byte in enumerate(HELLO_FRAME):
            frames = decoder.feed(bytes([byte]))
            if i < len(HELLO_FRAME) - 1:
                self.assertEqual(frames, [])
            delivered += frames
        self.assertEqual([decode_frame(f) for f in delivered], [HELLO])
        self.assertEqual(decoder.buffered, 0)

    def test_several_frames_in_one_feed(self) -> None:
        """Several frames in one feed are all delivered, in order; a partial tail waits."""
        decoder = FrameDecoder()
        data = HELLO_FRAME + KEEPALIVE_FRAME + WATERMARK_ACK_FRAME + HELLO_FRAME[:5]
        frames = decoder.feed(data)
        self.assertEqual(
            [f.msg_type for f in frames],
            [MsgType.HELLO, MsgType.KEEPALIVE, MsgType.WATERMARK_ACK],
        )
        self.assertEqual([f.seq for f in frames], [1, 7, 1])
        self.assertEqual(decoder.buffered, 5)
        (last,) = decoder.feed(HELLO_FRAME[5:])
        self.assertEqual(decode_frame(last), HELLO)

    def test_envelope_fields_not_validated(self) -> None:
        """proto_version, seq and correlation_id are never checked by the receiver."""
        frame = struct.pack("<IHHQQB", HEADER_LEN + 5, 99, 0x000F, U64_MAX, 12345, 0)
        (decoded,) = FrameDecoder().feed(frame + bytes.fromhex("9401056403"))
        self.assertEqual(decoded.seq, U64_MAX)
        self.assertEqual(decode_frame(decoded), WATERMARK_ACK)


class EncoderTests(SynchronousTestCase):
    def test_frame_too_large(self) -> None:
        """A payload one byte over the largest is refused with FrameTooLarge; the largest fits."""
        self.assertRaises(FrameTooLarge, encode_frame, MsgType.TELEMETRY, 1, bytes(MAX_PAYLOAD + 1))
        frame = encode_frame(MsgType.TELEMETRY, 1, bytes(MAX_PAYLOAD))
        self.assertEqual(len(frame), 4 + MAX_FRAME)

    def test_class_range_mismatch(self) -> None:
        """An encoder asked for a class that does not match the type fails."""
        self.assertRaises(ClassRangeMismatch, encode_frame, MsgType.HELLO, 1, b"", 1)
        self.assertRaises(ClassRangeMismatch, encode_frame, MsgType.KEEPALIVE, 1, b"\xc0", 0)
        self.assertEqual(encode_frame(MsgType.KEEPALIVE, 7, b"\xc0", 1), KEEPALIVE_FRAME)

    def test_class_derived_from_type(self) -> None:
        """The class byte is 1 for the droppable range and 0 otherwise (docs/protocol.md section
        2.2)."""
        self.assertEqual(encode_frame(MsgType.TELEMETRY, 1, b"")[24], 1)
        self.assertEqual(encode_frame(MsgType.HELLO, 1, b"")[24], 0)


# --------------------------------------------------------------------------------------------
# Payload strictness (docs/protocol.md section 3)


class PayloadStrictnessTests(SynchronousTestCase):
    def assert_payload_error(self, msg_type: MsgType, payload: bytes) -> None:
        self.assertRaises(PayloadError, decode_message, msg_type, payload)

    def test_negative_ints(self) -> None:
        """A negative integer where an unsigned one is declared is rejected (M2)."""
        self.assert_payload_error(MsgType.WATERMARK_ACK, raw_pack([-1, 5, 100, 3]))
        self.assert_payload_error(MsgType.WATERMARK_ACK, raw_pack([1, 5, 100, -(2**63)]))

    def test_ints_out_of_width(self) -> None:
        """u8, u16 and u32 fields reject a value one past their width; the maximum fits (M2)."""
        self.assert_payload_error(MsgType.HELLO, raw_pack([[65536, 2], [2], b""]))
        self.assertEqual(
            decode_message(MsgType.HELLO, raw_pack([[65535, 2], [2], b""])),
            Hello((65535, 2), LinkRole.HEAD_DAEMON, b""),
        )
        self.assert_payload_error(MsgType.XFER_ABORT, raw_pack([1, U32_MAX + 1]))
        self.assertEqual(
            decode_message(MsgType.XFER_ABORT, raw_pack([U64_MAX, U32_MAX])),
            wire.XferAbortMsg(U64_MAX, U32_MAX),
        )
        assign = [1, 2, 3, [1000, 600], "chatml", b"", 256, 0]
        self.assert_payload_error(MsgType.SESSION_ASSIGN, raw_pack(assign))
        self.assert_payload_error(
            MsgType.STAGE_FORWARD_REQ, raw_pack([1, [U32_MAX + 1], 0, 1, None])
        )

    def test_any_int_format_accepted(self) -> None:
        """A small value in a wide msgpack int format (uint64) decodes (M2)."""
        payload = b"\x94" + b"\xcf" + (1).to_bytes(8, "big") + b"\x05\x64\x03"
        self.assertEqual(decode_message(MsgType.WATERMARK_ACK, payload), WATERMARK_ACK)

    def test_bool_where_int(self) -> None:
        """true/false is not an integer (M2, M3)."""
        self.assert_payload_error(MsgType.WATERMARK_ACK, raw_pack([True, 5, 100, 3]))
        self.assert_payload_error(MsgType.WATERMARK_ACK, raw_pack([1, 5, 100, False]))

    def test_int_where_bool(self) -> None:
        """An integer is not a bool (M3)."""
        ack = [[7, 1, [], [[0, 0], 0]]]
        self.assert_payload_error(MsgType.RECONCILE_ACK, raw_pack([ack]))
        ack = [[7, True, [], [[0, 0], 0]]]
        self.assertTrue(decode_message(MsgType.RECONCILE_ACK, raw_pack([ack])).sessions[0].held)  # type: ignore[attr-defined]

    def test_hash_must_be_32_bytes(self) -> None:
        """[u8; 32] is a bin of exactly 32 bytes: 31 and 33 are rejected (M7)."""
        self.assert_payload_error(MsgType.BLOB_FETCH, raw_pack([bytes(31)]))
        self.assert_payload_error(MsgType.BLOB_FETCH, raw_pack([bytes(33)]))
        self.assertEqual(
            decode_message(MsgType.BLOB_FETCH, raw_pack([bytes(32)])), BlobFetchMsg(bytes(32))
        )
        self.assert_payload_error(
            MsgType.APPEND_CONTENT, raw_pack([1, 1, 1, b"", [], [bytes(32), bytes(31)]])
        )

    def test_encoder_refuses_bad_hash(self) -> None:
        """The encoder refuses a hash that is not 32 bytes."""
        self.assertRaises(PayloadError, BlobFetchMsg(bytes(31)).payload)

    def test_maps_rejected_anywhere(self) -> None:
        """A map is rejected as the payload, as a field and deep inside an array."""
        self.assert_payload_error(MsgType.WATERMARK_ACK, raw_pack({}))
        self.assert_payload_error(MsgType.WATERMARK_ACK, raw_pack({1: 2}))
        self.assert_payload_error(MsgType.WATERMARK_ACK, raw_pack([{}, 5, 100, 3]))
        self.assert_payload_error(MsgType.WATERMARK_ACK, raw_pack([1, 5, 100, 3, {"x": 1}]))
        self.assert_payload_error(MsgType.TOKEN_EVENTS, raw_pack([[[1, 5, 100, 0, [0, [{}]]]]]))

    def test_ext_rejected(self) -> None:
        """A msgpack extension type is rejected, even among ignored trailing elements."""
        ext = msgpack.ExtType(1, b"x")
        self.assert_payload_error(MsgType.WATERMARK_ACK, raw_pack([1, 5, 100, ext]))
        self.assert_payload_error(MsgType.WATERMARK_ACK, raw_pack([1, 5, 100, 3, ext]))
        self.assert_payload_error(
            MsgType.WATERMARK_ACK, b"\x94\x01\x05\x64\xd6\xff\x00\x00\x00\x00"
        )

    def test_timestamp_ext_rejected(self) -> None:
        """Extension type -1 (timestamp), which msgpack decodes itself, is rejected anywhere."""
        for timestamp in (
            "d6ff00000000",
            "d7ff0000000000000000",
            "c70cff" + "00" * 12,
            "c8000cff" + "00" * 12,
            "c80004ff" + "00" * 4,
            "c9000000" + "08ff" + "00" * 8,
        ):
            self.assert_payload_error(
                MsgType.WATERMARK_ACK, bytes.fromhex("9501056403" + timestamp)
            )
            self.assert_payload_error(MsgType.WATERMARK_ACK, bytes.fromhex(timestamp))
            self.assert_payload_error(
                MsgType.HELLO, bytes.fromhex("93920202" + "9202" + timestamp + "c400")
            )
        self.assertEqual(
            decode_message(MsgType.XFER_CHUNK, raw_pack([1, 2, b"\xd6\xff\x00\x00\x00\x00"])),
            wire.XferChunkMsg(1, 2, b"\xd6\xff\x00\x00\x00\x00"),
        )

    def test_trailing_bytes_rejected(self) -> None:
        """A payload is exactly one msgpack object: anything after it is an error."""
        self.assert_payload_error(MsgType.WATERMARK_ACK, bytes.fromhex("9401056403") + b"\xc0")
        self.assert_payload_error(MsgType.WATERMARK_ACK, bytes.fromhex("9401056403") + b"\x00")

    def test_empty_and_malformed_payloads(self) -> None:
        """An empty payload, a reserved byte or a cut-off object is a PayloadError."""
        self.assert_payload_error(MsgType.WATERMARK_ACK, b"")
        self.assert_payload_error(MsgType.WATERMARK_ACK, b"\xc1")
        self.assert_payload_error(MsgType.WATERMARK_ACK, bytes.fromhex("94010564"))

    def test_too_short_arrays_rejected(self) -> None:
        """An array shorter than the declared field count is rejected, also when nested."""
        self.assert_payload_error(MsgType.WATERMARK_ACK, raw_pack([1, 5, 100]))
        self.assert_payload_error(MsgType.WATERMARK_ACK, raw_pack([]))
        self.assert_payload_error(MsgType.LEASE_GRANT, raw_pack([1, 5, 100]))
        self.assert_payload_error(MsgType.HELLO, raw_pack([[2], [2], b""]))
        self.assert_payload_error(MsgType.TOKEN_EVENTS, raw_pack([[[1, 5, 100, 0]]]))
        self.assert_payload_error(MsgType.TOKEN_EVENTS, raw_pack([[[1, 5, 100, 0, [0]]]]))
        self.assert_payload_error(MsgType.TOKEN_EVENTS, raw_pack([[[1, 5, 100, 0, [1, [0]]]]]))
        self.assert_payload_error(MsgType.TOKEN_EVENTS, raw_pack([[[1, 5, 100, 0, []]]]))

    def test_extra_trailing_elements_ignored(self) -> None:
        """Extra trailing array elements are ignored, at the top and in nested structs."""
        self.assertEqual(
            decode_message(MsgType.WATERMARK_ACK, raw_pack([1, 5, 100, 3, 7, "new", [1]])),
            WATERMARK_ACK,
        )
        self.assertEqual(
            decode_message(MsgType.HELLO, raw_pack([[2, 2, 9], [2, 0], b"", None])), HELLO
        )
        events = [[1, 5, 100, 0, [0, [7, 8], "x"], 9], [1, 5, 100, 1, [3, 2, 0]]]
        self.assertEqual(decode_message(MsgType.TOKEN_EVENTS, raw_pack([events, 1])), TOKEN_EVENTS)

    def test_not_an_array(self) -> None:
        """A struct that arrives as a scalar is rejected."""
        self.assert_payload_error(MsgType.WATERMARK_ACK, raw_pack(5))
        self.assert_payload_error(MsgType.WATERMARK_ACK, raw_pack(None))
        self.assert_payload_error(MsgType.LEASE_GRANT, raw_pack("abcd"))

    def test_invalid_utf8_rejected(self) -> None:
        """A str that is not UTF-8 is a decode error (M5)."""
        ack = [2, b"\xff\xfe", [0] * 14, [], 0, [16777216, 8, 1, 1]]
        payload = msgpack.packb(ack, use_bin_type=False)
        self.assert_payload_error(MsgType.HELLO_ACK_F, payload)
        ack[1] = "node-ü"
        decoded = decode_message(MsgType.HELLO_ACK_F, raw_pack(ack))
        self.assertEqual(decoded.node_identity, "node-ü")  # type: ignore[attr-defined]

    def test_str_and_bin_not_interchangeable(self) -> None:
        """A str where bin is declared, or bin where str is declared, is rejected (M5, M6)."""
        self.assert_payload_error(MsgType.HELLO, raw_pack([[2, 2], [2], "auth"]))
        self.assert_payload_error(
            MsgType.HELLO_ACK_F, raw_pack([2, b"node", [0] * 14, [], 0, [16777216, 8, 1, 1]])
        )

    def test_bad_enum_index(self) -> None:
        """An enum index outside the declaration is rejected (M11)."""
        self.assert_payload_error(MsgType.HELLO, raw_pack([[2, 2], [3], b""]))
        self.assert_payload_error(MsgType.HELLO, raw_pack([[2, 2], [], b""]))
        self.assert_payload_error(MsgType.HELLO, raw_pack([[2, 2], [True], b""]))
        self.assert_payload_error(MsgType.TOKEN_EVENTS, raw_pack([[[1, 5, 100, 0, [4, 1]]]]))
        self.assert_payload_error(MsgType.TOKEN_EVENTS, raw_pack([[[1, 5, 100, 0, [False, [1]]]]]))

    def test_float64_narrowed_for_f32(self) -> None:
        """A float64 where f32 is declared is accepted and narrowed to float32 (M4)."""
        params = GenParams.from_wire(wire.unpack(raw_pack([0.1, 0.9, 0.05, 40, 7])))
        self.assertEqual(params.temperature, wire.to_f32(0.1))
        self.assertNotEqual(params.temperature, 0.1)
        self.assertEqual(params.top_p, struct.unpack("<f", struct.pack("<f", 0.9))[0])
        self.assertEqual((params.top_k, params.seed), (40, 7))
        self.assertEqual(decode_params(raw_pack([0.1, 0.9, 0.05, 40, 7])), params)

    def test_ints_accepted_for_f32(self) -> None:
        """An integer where f32 is declared is accepted as that float (M4)."""
        params = decode_params(raw_pack([1, 0, 0, 5, 42]))
        self.assertEqual(params, GenParams(1.0, 0.0, 0.0, 5, 42))
        self.assertIsInstance(params.temperature, float)

    def test_f32_encoded_as_float32(self) -> None:
        """f32 fields go out as msgpack float32 (0xca), never float64 (M4)."""
        blob = encode_params(GenParams(0.5, 0.25, 0.0, 1, 2))
        self.assertEqual(blob.count(b"\xca"), 3)
        self.assertNotIn(b"\xcb", blob)

    def test_u64_shortest_form(self) -> None:
        """Integers are written in their shortest msgpack form (M2)."""
        self.assertEqual(wire.LeaseRenewMsg(1, U64_MAX).payload(), b"\x92\x01\xcf" + b"\xff" * 8)
        self.assertEqual(wire.LeaseRenewMsg(127, 128).payload(), b"\x92\x7f\xcc\x80")

    def test_embed_messages(self) -> None:
        """EMBED_REQ and EMBED_RESP are the arrays of section 12.7 (its example, byte for
        byte), and a refusal's vectors are nil."""
        resp = wire.EmbedRespMsg(7, struct.pack("<ff", 1.0, -2.0), 2, 3)
        self.assertEqual(resp.payload().hex(), "9407c4080000803f000000c00203")
        self.assertEqual(decode_message(MsgType.EMBED_RESP, resp.payload()), resp)
        refused = wire.EmbedRespMsg(8, None, 0, 0)
        self.assertEqual(refused.payload(), raw_pack([8, None, 0, 0]))
        request = wire.EmbedReqMsg(7, ("a", "bc"))
        self.assertEqual(request.payload(), raw_pack([7, ["a", "bc"]]))
        self.assertEqual(decode_message(MsgType.EMBED_REQ, request.payload()), request)
        self.assertRaises(PayloadError, decode_message, MsgType.EMBED_REQ, raw_pack([7, [1]]))
        self.assertEqual((MsgType.EMBED_REQ, MsgType.EMBED_RESP), (0x001B, 0x001C))

    def test_kept_stage_messages(self) -> None:
        """STAGE_FORWARD_REQ's stage session and position are appended only when set, byte
        for byte as section 12.8's example; the stateless five elements still decode; one
        without the other is malformed; STAGE_RELEASE is 0x001D, ``91 05`` for session 5 and
        held to the small payload limit."""
        kept = wire.StageForwardReqMsg(7, (31198,), 0, 12, None, 5, 12)
        self.assertEqual(kept.payload().hex(), "970791cd79de000cc0050c")
        self.assertEqual(decode_message(MsgType.STAGE_FORWARD_REQ, kept.payload()), kept)
        self.assertTrue(kept.kept)
        stateless = wire.StageForwardReqMsg(7, (1, 2), 0, 12, None)
        self.assertEqual(stateless.payload(), raw_pack([7, [1, 2], 0, 12, None]))
        self.assertFalse(decode_message(MsgType.STAGE_FORWARD_REQ, stateless.payload()).kept)
        self.assertRaises(
            PayloadError,
            decode_message,
            MsgType.STAGE_FORWARD_REQ,
            raw_pack([7, [1], 0, 12, None, 5, None]),
        )
        release = wire.StageReleaseMsg(5)
        self.assertEqual(release.payload().hex(), "9105")
        self.assertEqual(decode_message(MsgType.STAGE_RELEASE, release.payload()), release)
        self.assertEqual(int(MsgType.STAGE_RELEASE), 0x001D)
        self.assertEqual(wire.PAYLOAD_LIMITS[0x001D], wire.SMALL_PAYLOAD)

    def test_stage_batch_messages(self) -> None:
        """STAGE_BATCH_REQ (0x001E) carries the rows of several stage sessions through one
        layer range and STAGE_BATCH_RESP (0x001F) one answer per row (section 12.8, D28):
        byte for byte as the section's example, both round-trip, and a batch without rows, with
        a session twice, with a short row or with answers that are not an array is malformed;
        feature bit 8 is 0x100."""
        request = wire.StageBatchReqMsg(
            7,
            0,
            12,
            (wire.StageBatchRow(5, 12, (31198,), None), wire.StageBatchRow(6, 3, (), b"h")),
        )
        self.assertEqual(request.payload().hex(), "9407000c9294050c91cd79dec094060390c40168")
        self.assertEqual(decode_message(MsgType.STAGE_BATCH_REQ, request.payload()), request)
        answer = wire.StageBatchRespMsg(
            7, (wire.StageBatchAnswer(b"h", None), wire.StageBatchAnswer(None, 16521))
        )
        self.assertEqual(answer.payload().hex(), "92079292c40168c092c0cd4089")
        self.assertEqual(decode_message(MsgType.STAGE_BATCH_RESP, answer.payload()), answer)
        for bad in (
            [7, 0, 12, []],
            [7, 0, 12, [[5, 0, [1], None], [5, 1, [2], None]]],
            [7, 0, 12, [[5, 0, [1]]]],
            [7, 0, 12, [[5, 0, 1, None]]],
        ):
            with self.subTest(bad=bad):
                self.assertRaises(
                    PayloadError, decode_message, MsgType.STAGE_BATCH_REQ, raw_pack(bad)
                )
        for bad in ([7, None], [7, [[b"h"]]], [7, [[None, -1]]]):
            with self.subTest(bad=bad):
                self.assertRaises(
                    PayloadError, decode_message, MsgType.STAGE_BATCH_RESP, raw_pack(bad)
                )
        self.assertEqual((int(MsgType.STAGE_BATCH_REQ), int(MsgType.STAGE_BATCH_RESP)), (30, 31))
        self.assertEqual(wire.FEATURE_STAGE_BATCH, 0x100)

    def test_stage_ring_messages(self) -> None:
        """STAGE_RING_JOIN (0x0020), STAGE_RING_ROWS (0x0021) and STAGE_RING_TOKENS (0x0022)
        of section 12.10 (D29): byte for byte as the section's examples, all round-trip, and
        the section's malformed forms are refused; feature bit 9 is 0x200."""
        rows = wire.StageRingRowsMsg(7, (wire.StageRingRow(5, 12, (31198,), None, 3, (2,)),))
        self.assertEqual(rows.payload().hex(" "), "92 07 91 96 05 0c 91 cd 79 de c0 03 91 02")
        tokens = wire.StageRingTokensMsg(
            7, (wire.StageRingToken(5, 13, 16521), wire.StageRingToken(6, 4, None))
        )
        self.assertEqual(tokens.payload().hex(" "), "92 07 92 93 05 0d cd 40 89 93 06 04 c0")
        join = wire.StageRingJoinMsg(7, 0, 12, "tcp:127.0.0.1:8454")
        self.assertEqual(join.payload(), bytes.fromhex("9407000cb2") + b"tcp:127.0.0.1:8454")
        for message in (rows, tokens, join):
            with self.subTest(message=type(message).__name__):
                self.assertEqual(decode_message(message.MSG_TYPE, message.payload()), message)
        malformed = {
            MsgType.STAGE_RING_JOIN: (
                [7, 0, 12, ""],
                [7, 0, 12, "t" * 513],
                [7, 12, 12, "tcp:h:1"],
                [7, 0, 12],
            ),
            MsgType.STAGE_RING_ROWS: (
                [7, []],
                [7, [[5, 0, [1], None, 1, []], [5, 1, [2], None, 1, []]]],
                [7, [[5, 0, [1], None, 1]]],
                [7, [[5, 0, [1], None, 0, []]]],
            ),
            MsgType.STAGE_RING_TOKENS: ([7, []], [7, [[5, 1]]], [7, [[5, 1, -1]]]),
        }
        for msg_type, forms in malformed.items():
            for bad in forms:
                with self.subTest(msg_type=msg_type.name, bad=bad):
                    self.assertRaises(PayloadError, decode_message, msg_type, raw_pack(bad))
        self.assertEqual(
            [int(t) for t in (MsgType.STAGE_RING_JOIN, MsgType.STAGE_RING_ROWS)], [0x20, 0x21]
        )
        self.assertEqual(int(MsgType.STAGE_RING_TOKENS), 0x22)
        self.assertEqual(wire.PAYLOAD_LIMITS[0x20], wire.SMALL_PAYLOAD)
        self.assertEqual(wire.FEATURE_STAGE_RING, 0x200)

    def test_optional_nil(self) -> None:
        """Option<T> is nil for None and T otherwise (M10)."""
        resp = wire.StageForwardRespMsg(9, None, 5)
        self.assertEqual(resp.payload(), raw_pack([9, None, 5]))
        self.assertEqual(decode_message(MsgType.STAGE_FORWARD_RESP, resp.payload()), resp)

    def test_encoder_refuses_out_of_range(self) -> None:
        """The encoder refuses a negative value, one past the width, and a bool for an int."""
        self.assertRaises(PayloadError, wire.LeaseRenewMsg(-1, 0).payload)
        self.assertRaises(PayloadError, wire.XferAbortMsg(1, U32_MAX + 1).payload)
        self.assertRaises(PayloadError, wire.LeaseRenewMsg(True, 0).payload)
        self.assertRaises(
            PayloadError, TokenEventsMsg((TokenEvent(1, 1, 1, 0, Tokens((-1,))),)).payload
        )


class BlobTests(SynchronousTestCase):
    def test_gen_params_lenient(self) -> None:
        """Empty bytes or any malformed GenParams blob decodes to the all-zero default."""
        default = GenParams()
        self.assertEqual(default, GenParams(0.0, 0.0, 0.0, 0, 0))
        for blob in (
            b"",
            b"\xc1",
            b"\xc0",
            raw_pack({}),
            raw_pack([0.5, 0.5]),
            raw_pack([0.5, 0.5, 0.5, -1, 0]),
            raw_pack([0.5, 0.5, 0.5, U32_MAX + 1, 0]),
            raw_pack(["x", 0.5, 0.5, 1, 0]),
            GEN_PARAMS_BLOB + b"\x00",
            GEN_PARAMS_BLOB[:-1],
        ):
            self.assertEqual(decode_params(blob), default, blob)

    def test_gen_params_extra_fields_ignored(self) -> None:
        """A GenParams blob with appended fields still decodes."""
        self.assertEqual(
            decode_params(raw_pack([0.0, 1.0, 0.0, 0, 42, "later"])),
            GenParams(0.0, 1.0, 0.0, 0, 42),
        )

    def test_gen_params_greedy(self) -> None:
        """Temperature 0 means greedy."""
        self.assertTrue(GenParams().greedy)
        self.assertFalse(GenParams(temperature=0.7).greedy)

    def test_tokens_strict(self) -> None:
        """A malformed context blob is a PayloadError, never a default."""
        for blob in (
            b"",
            b"\xc1",
            raw_pack(None),
            raw_pack({}),
            raw_pack([-1]),
            raw_pack([U32_MAX + 1]),
            raw_pack([1.0]),
            raw_pack([True]),
            raw_pack([[1]]),
            raw_pack(b"\x01"),
            TOKENS_BLOB + b"\x00",
            TOKENS_BLOB[:-1],
        ):
            self.assertRaises(PayloadError, decode_tokens, blob)

    def test_tokens_edges(self) -> None:
        """The empty context and u32::MAX round-trip."""
        self.assertEqual(decode_tokens(encode_tokens([])), ())
        self.assertEqual(decode_tokens(encode_tokens([0, U32_MAX])), (0, U32_MAX))
        self.assertRaises(PayloadError, encode_tokens, [U32_MAX + 1])


# --------------------------------------------------------------------------------------------
# Handshake versions and catalog (docs/protocol.md section 10, items 1 and 2)


class NegotiateTests(SynchronousTestCase):
    def test_highest_common_version(self) -> None:
        """negotiate picks the highest version both ranges contain (item 1)."""
        self.assertEqual(negotiate((1, 5), (3, 7)), 5)
        self.assertEqual(negotiate((3, 7), (1, 5)), 5)
        self.assertEqual(negotiate((1, 10), (10, 10)), 10)
        self.assertEqual(negotiate((2, 2), (2, 2)), 2)

    def test_no_overlap(self) -> None:
        """Disjoint ranges have no version (item 1)."""
        self.assertIsNone(negotiate((1, 2), (3, 4)))
        self.assertIsNone(negotiate((5, 9), (1, 4)))
        self.assertIsNone(negotiate((3, 3), (2, 2)))

    def test_touching_ranges(self) -> None:
        """Ranges that share one end agree on it (item 1)."""
        self.assertEqual(negotiate((1, 3), (3, 5)), 3)
        self.assertEqual(negotiate((3, 5), (1, 3)), 3)


class CatalogTests(SynchronousTestCase):
    def test_every_type_known(self) -> None:
        """All 28 catalog types and sfnode's eight own types (sections 12.7, 12.8, 12.10)
        have a message class and pass the decoder (item 2)."""
        self.assertEqual(len(MsgType), 36)
        self.assertEqual(set(MESSAGE_CLASSES), set(MsgType))
        for msg_type, cls in MESSAGE_CLASSES.items():
            self.assertEqual(cls.MSG_TYPE, msg_type)
            (frame,) = FrameDecoder().feed(raw_frame(msg_type, b"\xc0"))
            self.assertEqual(frame.msg_type, msg_type)

    def test_unknown_type(self) -> None:
        """0x00FF is not in the catalog: the decoder and decode_message refuse it (item 2)."""
        self.assertNotIn(0x00FF, {int(t) for t in MsgType})
        self.assertRaises(UnknownRequiredType, FrameDecoder().feed, raw_frame(0x00FF))
        self.assertRaises(UnknownRequiredType, decode_message, 0x00FF, b"\xc0")
        self.assertRaises(UnknownRequiredType, decode_message, 0x8003, b"\xc0")

    def test_numbers_and_classes(self) -> None:
        """HELLO is 0x0001 (shared with Link W); only TELEMETRY and KEEPALIVE are droppable."""
        self.assertEqual(MsgType.HELLO, 0x0001)
        self.assertEqual(MsgType.STAGE_FORWARD_RESP, 0x001A)
        droppable = {t for t in MsgType if wire.frame_class(t) == wire.CLASS_DROPPABLE}
        self.assertEqual(droppable, {MsgType.TELEMETRY, MsgType.KEEPALIVE})
        self.assertEqual([int(t) for t in MsgType][:26], list(range(1, 27)))


# --------------------------------------------------------------------------------------------
# Property tests


def strategy_for(codec: Codec[Any]) -> st.SearchStrategy[Any]:
    """A strategy for the values one codec of sfnode.linkf.wire encodes, built from its
    parameters."""
    if isinstance(codec, UInt):
        return st.integers(min_value=0, max_value=codec.limit - 1)
    if isinstance(codec, Bool):
        return st.booleans()
    if isinstance(codec, F32):
        return st.floats(width=32, allow_nan=False)
    if isinstance(codec, Str):
        return st.text(max_size=12)
    if isinstance(codec, wire.Bin):
        if codec.exact is not None:
            return st.binary(min_size=codec.exact, max_size=codec.exact)
        return st.binary(max_size=24)
    if isinstance(codec, U32Array):
        return st.lists(st.integers(0, U32_MAX), max_size=6).map(tuple)
    if isinstance(codec, ArrayOf):
        return st.lists(strategy_for(codec.item), max_size=3).map(tuple)
    if isinstance(codec, Optional):
        return st.none() | strategy_for(codec.inner)
    if isinstance(codec, Pair):
        item = strategy_for(codec.item)
        return st.tuples(item, item)
    if isinstance(codec, UnitEnum):
        return st.sampled_from(list(codec.enum_cls))
    if isinstance(codec, StructCodec):
        return message_strategy(codec.cls)
    if isinstance(codec, wire.BoundedStr):
        return st.text(max_size=12)
    if isinstance(codec, wire.RangedF32):
        return st.floats(codec.low, codec.high, width=32)
    if isinstance(codec, wire.LogitBiasCodec):
        bias = st.floats(*wire.LOGIT_BIAS_RANGE, width=32)
        return st.lists(st.tuples(st.integers(0, U32_MAX), bias), max_size=3).map(tuple)
    if isinstance(codec, wire.GrammarCodec):
        return st.one_of(
            st.just(wire.JsonObjectGrammar()),
            st.builds(wire.JsonSchemaGrammar, st.text(max_size=12)),
            st.builds(
                wire.ToolsGrammar,
                st.text(max_size=12),
                st.sampled_from(list(wire.ToolChoice)),
                st.text(max_size=8),
                st.booleans(),
            ),
        )
    if isinstance(codec, TokenEventPayloadCodec):
        return st.one_of(
            st.lists(st.integers(0, U32_MAX), max_size=6).map(lambda t: Tokens(tuple(t))),
            st.builds(Segment, st.sampled_from(list(SegmentKind)), st.binary(max_size=16)),
            st.builds(Usage, strategy_for(UsageMsg.as_codec())),
            st.builds(Finish, st.integers(0, U32_MAX), st.integers(0, U32_MAX)),
        )
    raise AssertionError(f"no strategy for {codec!r}")


_ROWS_OF: dict[type[Any], type[Any]] = {
    wire.StageBatchReqMsg: wire.StageBatchRow,
    wire.StageRingRowsMsg: wire.StageRingRow,
}


def message_strategy(cls: type[Any]) -> st.SearchStrategy[Any]:
    """A strategy for a wire struct, one argument per entry of its FIELDS (a STAGE_BATCH_REQ's
    and a STAGE_RING_ROWS's rows: at least one, each of its own session, as sections 12.8 and
    12.10 require; a STAGE_RING_TOKENS's tokens and a STAGE_RING_JOIN's endpoint and layers as
    12.10 requires)."""
    if cls in _ROWS_OF:
        rows = st.lists(
            message_strategy(_ROWS_OF[cls]),
            min_size=1,
            max_size=3,
            unique_by=lambda row: row.stage_session,
        ).map(tuple)
        return st.builds(cls, *[strategy_for(c) for c in cls.FIELDS[:-1]], rows)
    if cls is wire.StageRingRow:
        return st.builds(
            cls,
            *[strategy_for(c) for c in cls.FIELDS[:4]],
            st.integers(1, U32_MAX),
            strategy_for(cls.FIELDS[5]),
        )
    if cls is wire.StageRingTokensMsg:
        tokens = st.lists(message_strategy(wire.StageRingToken), min_size=1, max_size=3)
        return st.builds(cls, strategy_for(wire.U64), tokens.map(tuple))
    if cls is wire.StageRingJoinMsg:
        layers = st.tuples(st.integers(0, 99), st.integers(1, 99)).filter(lambda r: r[0] < r[1])
        return layers.flatmap(
            lambda r: st.builds(
                cls,
                strategy_for(wire.U64),
                st.just(r[0]),
                st.just(r[1]),
                st.text(min_size=1, max_size=12),
            )
        )
    return st.builds(cls, *[strategy_for(c) for c in cls.FIELDS])


def _round_trip_test(cls: type[Message]) -> Any:
    @PER_TYPE_SETTINGS
    @given(message=message_strategy(cls), seq=st.integers(0, U64_MAX))
    def test(self: SynchronousTestCase, message: Message, seq: int) -> None:
        decoder = FrameDecoder()
        (frame,) = decoder.feed(message_frame(message, seq))
        self.assertEqual(decoder.buffered, 0)
        self.assertEqual((frame.msg_type, frame.seq), (cls.MSG_TYPE, seq))
        self.assertEqual(decode_frame(frame), message)

    test.__doc__ = f"Every {cls.__name__} survives encode, the decoder and decode unchanged."
    return test


class RoundTripTests(SynchronousTestCase):
    """One property test per message type of the catalog (added below the class)."""

    @PROPERTY_SETTINGS
    @given(params=message_strategy(GenParams))
    def test_gen_params_round_trip(self, params: GenParams) -> None:
        """Every GenParams with float32 values survives its blob unchanged."""
        self.assertEqual(decode_params(encode_params(params)), params)

    @PROPERTY_SETTINGS
    @given(tokens=st.lists(st.integers(0, U32_MAX), max_size=64))
    def test_tokens_round_trip(self, tokens: list[int]) -> None:
        """Every context survives its blob unchanged."""
        self.assertEqual(decode_tokens(encode_tokens(tokens)), tuple(tokens))


for _cls in MESSAGE_CLASSES.values():
    setattr(RoundTripTests, f"test_round_trip_{_cls.MSG_TYPE.name.lower()}", _round_trip_test(_cls))
del _cls

any_message = st.sampled_from(list(MESSAGE_CLASSES.values())).flatmap(message_strategy)


def feed_all(data: bytes, chunk: int) -> None:
    """Feed ``data`` in chunks, decode every frame and finish, letting only WireErrors out."""
    decoder = FrameDecoder()
    try:
        for start in range(0, len(data), max(chunk, 1)):
            for frame in decoder.feed(data[start : start + max(chunk, 1)]):
                decode_frame(frame)
        decoder.finish()
    except WireError:
        pass


class FuzzTests(SynchronousTestCase):
    @PROPERTY_SETTINGS
    @given(data=st.binary(max_size=256), chunk=st.integers(1, 64))
    def test_random_bytes(self, data: bytes, chunk: int) -> None:
        """Random bytes make the decoder raise nothing but WireError subclasses."""
        feed_all(data, chunk)

    @PROPERTY_SETTINGS
    @given(
        prefix=st.binary(max_size=8),
        msg_type=st.sampled_from([int(t) for t in MsgType] + [0x00FF, 0x8003]),
        payload=st.binary(max_size=64),
    )
    def test_random_payloads_of_known_types(
        self, prefix: bytes, msg_type: int, payload: bytes
    ) -> None:
        """Well-framed random payloads of every type give only WireErrors."""
        feed_all(raw_frame(msg_type, prefix + payload), 1024)

    @PROPERTY_SETTINGS
    @given(message=any_message, data=st.data())
    def test_truncations(self, message: Message, data: st.DataObject) -> None:
        """A valid frame cut anywhere (or its payload cut and re-framed) gives only WireErrors."""
        frame = message_frame(message, 1)
        cut = data.draw(st.integers(0, len(frame)))
        feed_all(frame[:cut], 7)
        payload = message.payload()
        feed_all(
            raw_frame(message.MSG_TYPE, payload[: data.draw(st.integers(0, len(payload)))]), 64
        )

    @PROPERTY_SETTINGS
    @given(message=any_message, data=st.data())
    def test_bit_flips(self, message: Message, data: st.DataObject) -> None:
        """A valid frame with one to three bits flipped gives only WireErrors."""
        frame = bytearray(message_frame(message, 1) + message_frame(message, 2))
        for _ in range(data.draw(st.integers(1, 3))):
            bit = data.draw(st.integers(0, len(frame) * 8 - 1))
            frame[bit // 8] ^= 1 << (bit % 8)
        feed_all(bytes(frame), data.draw(st.integers(1, 64)))

    @PROPERTY_SETTINGS
    @given(message=any_message, data=st.data())
    def test_payload_bit_flips(self, message: Message, data: st.DataObject) -> None:
        """Bit flips confined to the payload (the envelope intact) give only PayloadErrors."""
        payload = bytearray(message.payload())
        if payload:
            bit = data.draw(st.integers(0, len(payload) * 8 - 1))
            payload[bit // 8] ^= 1 << (bit % 8)
        try:
            decode_message(message.MSG_TYPE, bytes(payload))
        except PayloadError:
            pass


class FramesBeforeAnErrorTests(SynchronousTestCase):
    def test_frames_ahead_of_bad_bytes_are_kept(self) -> None:
        """Whole frames that arrive in the same chunk ahead of bad bytes are handed back on
        the error (``frames_before``), in order, so nothing valid is lost."""
        good = [message_frame(WatermarkAckMsg(1, 5, 100, n), n + 1) for n in range(3)]
        decoder = FrameDecoder()
        with self.assertRaises(BadLength) as raised:
            decoder.feed(b"".join(good) + b"\x05\x00\x00\x00")
        self.assertEqual(
            [decode_frame(f) for f in raised.exception.frames_before],
            [WatermarkAckMsg(1, 5, 100, n) for n in range(3)],
        )

    def test_feed_whole_returns_the_frames_and_the_error(self) -> None:
        """``feed_whole`` (what both sides' protocols call) gives the same frames and the
        error instead of raising; bytes without an error give the frames and None."""
        good = [message_frame(WatermarkAckMsg(1, 5, 100, n), n + 1) for n in range(3)]
        frames, error = FrameDecoder().feed_whole(b"".join(good))
        self.assertIsNone(error)
        self.assertEqual(len(frames), 3)
        frames, error = FrameDecoder().feed_whole(b"".join(good) + b"\x05\x00\x00\x00")
        self.assertIsInstance(error, BadLength)
        self.assertEqual(
            [decode_frame(f) for f in frames], [WatermarkAckMsg(1, 5, 100, n) for n in range(3)]
        )


class TokenEventsHotPathTests(SynchronousTestCase):
    def test_bools_and_bad_ints_in_tokens_are_rejected_from_bytes(self) -> None:
        """The TOKEN_EVENTS fast path (decode_message) rejects a bool, a negative int, a value
        past u32 and a float among the tokens, exactly as the generic path does."""
        for bad in (True, False, -1, 1 << 32, 1.5):
            obj = [[[1, 5, 100, 0, [0, [7, bad, 8]]]]]
            payload = msgpack.packb(obj, use_bin_type=True)
            with self.assertRaises(PayloadError):
                decode_message(MsgType.TOKEN_EVENTS, payload)
            with self.assertRaises(PayloadError):
                TokenEventsMsg.from_wire(msgpack.unpackb(payload))

    def test_token_values_that_look_like_bool_bytes_are_accepted(self) -> None:
        """Tokens whose encoding holds the bytes c2/c3 (194, 195) decode normally."""
        message = TokenEventsMsg((TokenEvent(1, 5, 100, 0, Tokens((0, 1, 194, 195, 50000))),))
        self.assertEqual(decode_message(MsgType.TOKEN_EVENTS, message.payload()), message)
