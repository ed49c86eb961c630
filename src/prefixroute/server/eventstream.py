"""AWS event-stream framing (``application/vnd.amazon.eventstream``), encoder only.

What ``InvokeEndpointWithResponseStream`` returns: a sequence of binary messages, each

====================  ======  ==================================================
total length          4 B     big-endian uint32, the whole message
headers length        4 B     big-endian uint32
prelude CRC           4 B     CRC-32 (zlib) of the 8 bytes above
headers               n B     each: name length (1 B), name, type (1 B; 7 = string),
                              value length (2 B, big-endian), UTF-8 value
payload               m B
message CRC           4 B     CRC-32 of everything before it
====================  ======  ==================================================

This is the format botocore's ``EventStreamBuffer`` decodes (``botocore/eventstream.py``).
SageMaker's ``ResponseStream`` (botocore's ``sagemaker-runtime`` service model) has:

* ``PayloadPart``: ``:message-type`` ``event``, ``:event-type`` ``PayloadPart``; its only
  member ``Bytes`` is a blob with the ``eventpayload`` trait, so the message payload is
  the raw bytes of the part (botocore hands them over unchanged as ``PayloadPart.Bytes``).
* ``ModelStreamError`` and ``InternalStreamFailure``: ``:message-type`` ``exception``,
  ``:exception-type`` the shape name, a JSON payload ``{"Message": ..., "ErrorCode": ...}``;
  botocore raises ``EventStreamError`` with that code while the caller iterates.

No maintained encoder exists on PyPI (botocore only decodes), so the few lines that
build a message live here; the tests decode what they produce with botocore itself.
"""

from __future__ import annotations

import struct
import zlib
from typing import Iterable

import orjson

__all__ = [
    "CONTENT_TYPE",
    "MAX_PAYLOAD_BYTES",
    "encode_message",
    "payload_part",
    "model_stream_error",
    "internal_stream_failure",
]

#: Content type of an event-stream response.
CONTENT_TYPE = "application/vnd.amazon.eventstream"
#: Largest payload put in one message; the format allows 16 MiB per message, and a
#: longer upstream chunk is split over several PayloadPart events.
MAX_PAYLOAD_BYTES = 1 << 20

_STRING = 7  # header value type: string (utf-8), 2-byte length


def _headers(headers: Iterable[tuple[str, str]]) -> bytes:
    out = bytearray()
    for name, value in headers:
        n = name.encode("utf-8")
        v = value.encode("utf-8")
        if len(n) > 255 or len(v) > 65535:
            raise ValueError(f"event-stream header {name!r} is too long")
        out += struct.pack(">B", len(n)) + n + struct.pack(">BH", _STRING, len(v)) + v
    return bytes(out)


def _frame(header_bytes: bytes, payload: bytes) -> bytes:
    total = 12 + len(header_bytes) + len(payload) + 4
    prelude = struct.pack(">II", total, len(header_bytes))
    head = prelude + struct.pack(">I", zlib.crc32(prelude))
    crc = zlib.crc32(payload, zlib.crc32(header_bytes, zlib.crc32(head)))
    return b"".join((head, header_bytes, payload, struct.pack(">I", crc)))


def encode_message(headers: Iterable[tuple[str, str]], payload: bytes) -> bytes:
    """One event-stream message with string-valued ``headers`` and ``payload``.

    Raises:
        ValueError: a header name over 255 bytes or value over 65,535 bytes.
    """
    return _frame(_headers(headers), payload)


_PAYLOAD_PART_HEADERS = _headers(((":event-type", "PayloadPart"), (":content-type", "application/octet-stream"),
                                  (":message-type", "event")))


def payload_part(data: bytes) -> bytes:
    """``PayloadPart`` event(s) carrying ``data`` unchanged (split above
    :data:`MAX_PAYLOAD_BYTES`)."""
    if len(data) <= MAX_PAYLOAD_BYTES:
        return _frame(_PAYLOAD_PART_HEADERS, data)
    return b"".join(_frame(_PAYLOAD_PART_HEADERS, data[i:i + MAX_PAYLOAD_BYTES])
                    for i in range(0, len(data), MAX_PAYLOAD_BYTES))


def _exception(shape: str, body: dict[str, str]) -> bytes:
    return encode_message(((":exception-type", shape), (":content-type", "application/json"),
                           (":message-type", "exception")), orjson.dumps(body))


def model_stream_error(message: str, error_code: str) -> bytes:
    """``ModelStreamError`` exception event; ``error_code`` is ``StreamBroken`` (the
    model's connection was reset or closed) or ``ModelInvocationTimeExceeded``."""
    return _exception("ModelStreamError", {"Message": message, "ErrorCode": error_code})


def internal_stream_failure(message: str) -> bytes:
    """``InternalStreamFailure`` exception event (the router itself failed)."""
    return _exception("InternalStreamFailure", {"Message": message})
