"""HTTP header names the router reads and writes, and which headers cross the proxy.

Hop-by-hop headers (RFC 9110 §7.6.1: ``Connection`` and the headers it names,
``Keep-Alive``, ``TE``, ``Transfer-Encoding``, ``Upgrade``, ``Proxy-*``) are never
forwarded in either direction; ``Host`` and ``Content-Length`` are recomputed.

The functions take and return raw ``(name, value)`` byte pairs, so both data planes
(aiohttp's ``raw_headers``, httptools' callbacks) share one implementation.
"""

from __future__ import annotations

import hmac
from typing import Iterator, Mapping, Sequence

from multidict import CIMultiDict

from prefixroute.server import eventstream

__all__ = [
    "TARGET_VARIANT", "INFERENCE_COMPONENT", "CUSTOM_ATTRIBUTES", "PREFIX_AWARE_ID", "SESSION_ID", "NEW_SESSION_ID",
    "pin_new_session", "replace_header",
    "SAGEMAKER_ACCEPT", "SAGEMAKER_CONTENT_TYPE",
    "INVOKED_VARIANT", "INSTANCE", "DECISION", "OVERHEAD_MS", "REQUEST_ID", "INVOKED_COMPONENT", "RETRY_AFTER",
    "valid_request_id",
    "openai_upstream_headers", "openai_upstream_lines", "native_upstream_headers", "header_lines", "openai_response_headers", "openai_response_lines",
    "native_response_headers", "strip_secrets", "to_multidict", "RawHeaderView", "RawHeaders", "EVENTSTREAM_CONTENT_TYPE",
]

#: ``Content-Type`` of ``InvokeEndpointWithResponseStream`` answers (AWS event-stream).
EVENTSTREAM_CONTENT_TYPE = eventstream.CONTENT_TYPE.encode()

# Request headers (SageMaker runtime names).
TARGET_VARIANT = "X-Amzn-SageMaker-Target-Variant"
INFERENCE_COMPONENT = "X-Amzn-SageMaker-Inference-Component"
CUSTOM_ATTRIBUTES = "X-Amzn-SageMaker-Custom-Attributes"
PREFIX_AWARE_ID = "X-Amzn-SageMaker-Prefix-Aware-Id"
#: SageMaker's stateful sessions: ``NEW_SESSION`` or an id (:mod:`prefixroute.core.sessions`).
SESSION_ID = "X-Amzn-SageMaker-Session-Id"
#: The answer to ``NEW_SESSION``: ``ID; Expires=...`` (the router appends its pin tag to the id).
NEW_SESSION_ID = "X-Amzn-SageMaker-New-Session-Id"
#: ``InvokeEndpointWithResponseStream``'s ``Accept`` (sent to the container as ``Accept``).
SAGEMAKER_ACCEPT = "X-Amzn-SageMaker-Accept"

# Response headers.
INVOKED_VARIANT = "X-Amzn-Invoked-Production-Variant"
#: ``InvokeEndpointWithResponseStream``: the container's ``Content-Type`` (the HTTP
#: ``Content-Type`` is the event-stream's).
SAGEMAKER_CONTENT_TYPE = "X-Amzn-SageMaker-Content-Type"
#: The instance base URL that served the request.
INSTANCE = "X-Prefixroute-Instance"
#: Why: affinity, overflow, all_busy, fallback, random, least_outstanding.
DECISION = "X-Prefixroute-Decision"
#: Router time spent on the request in milliseconds (float): handler entry to upstream
#: send, plus upstream response headers received to our response headers prepared.
OVERHEAD_MS = "X-Prefixroute-Overhead-Ms"
#: Propagated from the request (or 32 generated random hex digits), sent upstream and back.
REQUEST_ID = "X-Request-Id"
#: The inference component that served the request (as ``X-Amzn-Invoked-Production-Variant``
#: names the variant); absent when the request named none.
INVOKED_COMPONENT = "X-Prefixroute-Inference-Component"
#: Seconds after which a 429 (a saturated LoRA sticky set) may be retried (RFC 9110 §10.2.3).
RETRY_AFTER = "Retry-After"
_REQUEST_ID_MAX = 200


def valid_request_id(value: str | None) -> bool:
    """True for an ``X-Request-Id`` worth propagating: 1-200 visible ASCII characters
    (anything else is replaced by a generated id, so logs and headers stay clean)."""
    return value is not None and 0 < len(value) <= _REQUEST_ID_MAX and all("!" <= c <= "~" for c in value)


#: A header as it came on the wire: ``(name, value)`` bytes (aiohttp's ``raw_headers``,
#: what httptools reports).
RawHeaders = Sequence[tuple[bytes, bytes]]

_HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"proxy-connection",
    b"te", b"trailer", b"trailers", b"transfer-encoding", b"upgrade", b"host", b"content-length", b"expect",
})
# Our own response headers: an upstream (e.g. another prefixroute) must not override them.
_OURS = frozenset({INVOKED_VARIANT.lower().encode(), INSTANCE.lower().encode(), DECISION.lower().encode(),
                   OVERHEAD_MS.lower().encode(), REQUEST_ID.lower().encode(), b"date", b"server"})
# The caller's trace context is replaced by the router's (tracecontext.py), which names
# the router's span as the engine's parent.
_DROP_UPSTREAM = frozenset({b"x-request-id", b"content-encoding", b"traceparent", b"tracestate"})
# Integrity fields computed over the body as the client encoded it (RFC 9530's
# Content-Digest and Repr-Digest, RFC 3230's Digest, RFC 1864's Content-MD5): wrong next
# to the decoded body sent on, so they are dropped with its Content-Encoding.
_DIGESTS = frozenset({b"content-digest", b"repr-digest", b"digest", b"content-md5"})
_DROP_DECODED = _DROP_UPSTREAM | _DIGESTS
_NATIVE_PASS = (b"content-type", b"accept")
_SAGEMAKER = b"x-amzn-sagemaker-"


def _end_to_end(headers: RawHeaders, also_drop: frozenset[bytes]) -> list[tuple[bytes, bytes]]:
    listed: frozenset[bytes] = frozenset()
    for k, v in headers:
        if k.lower() == b"connection":
            listed = listed | {t.strip().lower() for t in v.split(b",")}
    return [(k, v) for k, v in headers
            if (low := k.lower()) not in _HOP_BY_HOP and low not in also_drop and not low.startswith(b"proxy-")
            and low not in listed]


def _has(headers: RawHeaders, low_name: bytes) -> bool:
    return any(k.lower() == low_name for k, _ in headers)


#: Header names as looked up (``str``) -> lower-cased Latin-1 bytes, as RawHeaderView keys them.
_LOWER: dict[str, bytes] = {}


class RawHeaderView(Mapping[str, str]):
    """Raw request headers read by name, case-insensitively, without building a
    ``CIMultiDict`` (the fast data plane reads two to four headers of each request).

    ``view[name]`` and ``view.get(name)`` give the first header of that name, decoded as
    :func:`to_multidict` decodes it (UTF-8 with surrogate escapes); iteration gives the
    names as received (Latin-1), one per header line (duplicates included).
    The index of lower-cased names (each to its first value) is made on the first
    look-up, unless given (``index``: a parser that lower-cases the names anyway).
    """

    __slots__ = ("_raw", "_index")

    def __init__(self, raw: RawHeaders, index: dict[bytes, bytes] | None = None) -> None:
        self._raw = raw
        self._index = index

    def _lookup(self, name: str) -> bytes | None:
        index = self._index
        if index is None:
            index = self._index = {k.lower(): v for k, v in reversed(self._raw)}  # the first one wins
        low = _LOWER.get(name)
        if low is None:
            low = name.lower().encode("latin-1", "replace")
            if len(_LOWER) < 256:  # the names this package looks up, and a few more
                _LOWER[name] = low
        return index.get(low)

    def get(self, name: str, default: str | None = None) -> str | None:  # type: ignore[override]
        value = self._lookup(name)
        return default if value is None else value.decode("utf-8", "surrogateescape")

    def __getitem__(self, name: str) -> str:
        value = self._lookup(name)
        if value is None:
            raise KeyError(name)
        return value.decode("utf-8", "surrogateescape")

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._lookup(name) is not None

    def getall(self, name: str, default: list[str] | None = None) -> list[str]:
        """Every value of ``name``, in order (``CIMultiDict.getall``; ``default`` or
        ``[]`` when there is none)."""
        low = name.lower().encode("latin-1", "replace")
        out = [v.decode("utf-8", "surrogateescape") for k, v in self._raw if k.lower() == low]
        return out if out else (default if default is not None else [])

    def __iter__(self) -> Iterator[str]:
        return (k.decode("latin-1") for k, _ in self._raw)

    def __len__(self) -> int:
        return len(self._raw)


def to_multidict(headers: RawHeaders) -> CIMultiDict[str]:
    """Raw headers as aiohttp's ``CIMultiDict`` (names Latin-1; values UTF-8 with
    surrogate escapes, so any byte round-trips, as aiohttp decodes them). A name that
    comes again in another case (``X-A`` then ``x-a``) is spelled as it came first: the
    same field (RFC 9110 §5.1), and aiohttp's client keeps every line of a repeated
    name only when the spelling is the same (``ClientSession._prepare_headers``
    compares names case-sensitively and lets the later line replace the earlier)."""
    out: CIMultiDict[str] = CIMultiDict()
    spelled: dict[bytes, str] = {}
    for k, v in headers:
        name = spelled.get(low := k.lower())
        if name is None:
            name = spelled[low] = k.decode("latin-1")
        out.add(name, v.decode("utf-8", "surrogateescape"))
    return out


def openai_upstream_headers(headers: RawHeaders, request_id: str, decoded: bool = False) -> list[tuple[bytes, bytes]]:
    """Headers sent to the instance for an OpenAI request: the client's end-to-end
    headers (including ``Authorization``, which an engine run with ``--api-key`` needs),
    ``X-Request-Id``, and ``Accept-Encoding: identity`` unless the client chose one (we
    relay bytes undecoded, so the client must be able to read what the engine sends).
    ``Content-Encoding`` is dropped: the router decodes a compressed request body and
    forwards the decoded bytes. ``decoded`` (the body was gzip or deflate): its digests
    (``Content-Digest``, ``Repr-Digest``, ``Digest``, ``Content-MD5``), which no longer
    match, are dropped too."""
    out = _end_to_end(headers, _DROP_DECODED if decoded else _DROP_UPSTREAM)
    out.append((b"X-Request-Id", request_id.encode()))
    if not _has(out, b"accept-encoding"):
        out.append((b"Accept-Encoding", b"identity"))
    return out


def header_lines(headers: RawHeaders) -> bytes:
    """``headers`` formatted as HTTP header lines, ``Name: value\\r\\n`` each."""
    return b"".join([b"%s: %s\r\n" % kv for kv in headers])


def openai_upstream_lines(headers: RawHeaders, request_id: str, token: str | None = None,
                          decoded: bool = False) -> bytes:
    """``header_lines(strip_secrets(openai_upstream_headers(headers, request_id, decoded),
    token))`` (the same lines in the same order), in one pass over ``headers`` when no
    admin token is set and no ``Connection`` header names other headers (the usual
    request: a ``Connection: keep-alive`` at most); otherwise by those functions."""
    if token:
        return header_lines(strip_secrets(openai_upstream_headers(headers, request_id, decoded), token))
    found = _end_to_end_lines(headers, _DROP_DECODED if decoded else _DROP_UPSTREAM, b"accept-encoding")
    if found is None:  # a Connection header names others to drop
        return header_lines(openai_upstream_headers(headers, request_id, decoded))
    lines, accept_encoding = found
    lines.append(b"X-Request-Id: %s\r\n" % request_id.encode())
    if not accept_encoding:
        lines.append(b"Accept-Encoding: identity\r\n")
    return b"".join(lines)


def _end_to_end_lines(headers: RawHeaders, also_drop: frozenset[bytes],
                      note: bytes | None = None) -> tuple[list[bytes], bool] | None:
    """:func:`_end_to_end`'s headers as header lines, in one pass, and whether one of them
    is named ``note`` (lower-case); ``None`` when a ``Connection`` header names headers
    other than hop-by-hop ones (the caller then uses :func:`_end_to_end`)."""
    lines = []
    noted = False
    for k, v in headers:
        low = k.lower()
        if low in _HOP_BY_HOP or low in also_drop or low.startswith(b"proxy-"):
            if low == b"connection" and any(t.strip().lower() not in _HOP_BY_HOP for t in v.split(b",")):
                return None
            continue
        if low == note:
            noted = True
        lines.append(b"%s: %s\r\n" % (k, v))
    return lines, noted


def native_upstream_headers(headers: RawHeaders, request_id: str, stream: bool = False) -> list[tuple[bytes, bytes]]:
    """Headers sent to the instance for a native invocation. Like SageMaker, only the
    API's own headers pass (``Content-Type``, ``Accept``, ``X-Amzn-SageMaker-*``); the
    caller's AWS signature does not reach the model. ``stream``
    (``InvokeEndpointWithResponseStream``): the HTTP ``Accept`` is the event-stream's,
    so the container gets ``X-Amzn-SageMaker-Accept`` as its ``Accept``."""
    out = []
    for k, v in headers:
        low = k.lower()
        if (low in _NATIVE_PASS and not (stream and low == b"accept")) or low.startswith(_SAGEMAKER):
            out.append((k, v))
    if stream:
        accept = next((v for k, v in headers if k.lower() == SAGEMAKER_ACCEPT.lower().encode()), None)
        if accept:
            out.append((b"Accept", accept))
    out.append((b"X-Request-Id", request_id.encode()))
    out.append((b"Accept-Encoding", b"identity"))
    return out


def strip_secrets(headers: list[tuple[bytes, bytes]], token: str | None) -> list[tuple[bytes, bytes]]:
    """``headers`` without any header carrying ``token`` (the router's admin token: a
    client that sent it to the inference port must not leak it to the engines),
    compared in constant time, bare or as ``Bearer TOKEN`` (the scheme in any case, as
    the admin API accepts it: RFC 9110 §11.1)."""
    if not token:
        return headers
    secret = token.encode()
    return [(k, v) for k, v in headers if not hmac.compare_digest(_credentials(v), secret)]


def _credentials(value: bytes) -> bytes:
    """A header value without a leading ``Bearer`` scheme (any case) and blanks."""
    value = value.strip()
    scheme, sep, rest = value.partition(b" ")
    return rest.strip() if sep and scheme.lower() == b"bearer" else value


def openai_response_headers(upstream: RawHeaders) -> list[tuple[bytes, bytes]]:
    """The instance's end-to-end response headers, minus the ones the router sets."""
    return _end_to_end(upstream, _OURS)


def openai_response_lines(upstream: RawHeaders) -> bytes:
    """``header_lines(openai_response_headers(upstream))``, in one pass when it can be."""
    found = _end_to_end_lines(upstream, _OURS)
    return header_lines(openai_response_headers(upstream)) if found is None else b"".join(found[0])


def native_response_headers(upstream: RawHeaders, stream: bool = False) -> list[tuple[bytes, bytes]]:
    """What SageMaker returns of the model's headers: ``Content-Type`` and
    ``X-Amzn-SageMaker-*`` (custom attributes, session ids). ``stream``: the model's
    ``Content-Type`` becomes ``X-Amzn-SageMaker-Content-Type`` and ``Content-Type`` is
    the AWS event-stream's."""
    out = []
    content_type = None
    for k, v in upstream:
        low = k.lower()
        if low == b"content-type":
            if stream:
                content_type = content_type or v
                continue
            out.append((k, v))
        elif low.startswith(_SAGEMAKER):
            out.append((k, v))
    if stream and content_type is not None:
        out = [(k, v) for k, v in out if k.lower() != SAGEMAKER_CONTENT_TYPE.lower().encode()]
    if stream:
        if content_type is not None:
            out.append((SAGEMAKER_CONTENT_TYPE.encode(), content_type))
        out.append((b"Content-Type", EVENTSTREAM_CONTENT_TYPE))
    return out


def pin_new_session(upstream: RawHeaders, instance_id: str) -> list[tuple[bytes, bytes]]:
    """An answer's headers for a ``NEW_SESSION`` request served by ``instance_id``: the
    container's ``X-Amzn-SageMaker-New-Session-Id`` (if it made a session) replaced by
    the same id with the instance's pin tag, or one the router made
    (:func:`prefixroute.core.sessions.pin_session_id`)."""
    from prefixroute.core.sessions import pin_session_id

    name = NEW_SESSION_ID.lower().encode()
    theirs = next((v for k, v in upstream if k.lower() == name), None)
    out = [(k, v) for k, v in upstream if k.lower() != name]
    value = pin_session_id(theirs.decode("latin-1") if theirs is not None else None, instance_id)
    out.append((NEW_SESSION_ID.encode(), value.encode("latin-1")))
    return out


def replace_header(headers: RawHeaders, name: str, value: str) -> list[tuple[bytes, bytes]]:
    """``headers`` with every ``name`` header's value replaced by ``value``."""
    low = name.lower().encode()
    return [(k, value.encode("latin-1") if k.lower() == low else v) for k, v in headers]
