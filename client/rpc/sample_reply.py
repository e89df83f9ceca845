"""Sample replies read with one copy of their payload.

A batch is megabytes. Read as a protobuf message, its payload would be copied from gRPC's
bytes into the message and again out of it into the `bytes` a Batch holds; here the payload
field, which the server writes first (as protobuf's own serialiser does, field 1 first), is
cut from gRPC's bytes at once, and only the rest of the message is parsed. Anything else (no
payload first, a payload field repeated later, a malformed length) is read as a whole message,
as before.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from expbuf.proto.v1 import buffer_pb2 as pb

SAMPLE_METHOD = "/expbuf.v1.ExperienceBuffer/Sample"
_PAYLOAD_TAG = b"\x0a"  # field 1 (payload), length-delimited


class SampleReplyParts(NamedTuple):
    """A SampleReply as its payload and the rest of the message (whose payload is empty)."""

    payload: bytes
    rest: pb.SampleReply


def read_sample_reply(raw: bytes) -> SampleReplyParts:
    """The parts of a serialised SampleReply, its payload copied once."""
    if raw[:1] == _PAYLOAD_TAG:
        length, at = 0, 1
        for shift in range(0, 64, 7):
            if at >= len(raw):
                break
            byte = raw[at]
            at += 1
            length |= (byte & 0x7F) << shift
            if byte < 0x80:
                end = at + length
                if end <= len(raw):
                    rest = pb.SampleReply.FromString(raw[end:])
                    if not rest.payload:  # a later payload field would replace this one: the last one wins
                        return SampleReplyParts(raw[at:end], rest)
                break
    whole = pb.SampleReply.FromString(raw)
    payload = whole.payload
    whole.ClearField("payload")
    return SampleReplyParts(payload, whole)


def sample_method(channel: Any) -> Any:
    """The Sample stream of `channel` (blocking or asyncio) with replies read by read_sample_reply."""
    return channel.stream_stream(
        SAMPLE_METHOD,
        request_serializer=pb.SampleRequest.SerializeToString,
        response_deserializer=read_sample_reply,
    )
