"""HTTP header names the router reads and writes, and which headers cross the proxy.

Hop-by-hop headers (RFC 9110 §7.6.1: ``Connection`` and the headers it names,
``Keep-Alive``, ``TE``, ``Transfer-Encoding``, ``Upgrade``, ``Proxy-*``) are never
forwarded in either direction; ``Host`` and ``Content-Length`` are recomputed.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from multidict import CIMultiDict

__all__ = [
    "TARGET_VARIANT", "INFERENCE_COMPONENT", "CUSTOM_ATTRIBUTES", "PREFIX_AWARE_ID",
    "SAGEMAKER_ACCEPT", "SAGEMAKER_CONTENT_TYPE",
    "INVOKED_VARIANT", "INSTANCE", "DECISION", "OVERHEAD_MS", "REQUEST_ID", "valid_request_id",
    "openai_upstream_headers", "native_upstream_headers", "openai_response_headers",
    "native_response_headers",
]

# Request headers (SageMaker runtime names).
TARGET_VARIANT = "X-Amzn-SageMaker-Target-Variant"
INFERENCE_COMPONENT = "X-Amzn-SageMaker-Inference-Component"
CUSTOM_ATTRIBUTES = "X-Amzn-SageMaker-Custom-Attributes"
PREFIX_AWARE_ID = "X-Amzn-SageMaker-Prefix-Aware-Id"
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
#: Propagated from the request (or a generated uuid4 hex), sent upstream and back.
REQUEST_ID = "X-Request-Id"
_REQUEST_ID_MAX = 200


def valid_request_id(value: str | None) -> bool:
    """True for an ``X-Request-Id`` worth propagating: 1-200 visible ASCII characters
    (anything else is replaced by a generated id, so logs and headers stay clean)."""
    return value is not None and 0 < len(value) <= _REQUEST_ID_MAX and all("!" <= c <= "~" for c in value)


_HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
    "te", "trailer", "trailers", "transfer-encoding", "upgrade", "host", "content-length", "expect",
})
# Our own response headers: an upstream (e.g. another prefixroute) must not override them.
_OURS = frozenset({INVOKED_VARIANT.lower(), INSTANCE.lower(), DECISION.lower(), OVERHEAD_MS.lower(),
                   REQUEST_ID.lower(), "date", "server"})
_DROP_UPSTREAM = frozenset({"x-request-id", "content-encoding"})


def _connection_listed(headers: Mapping[str, str]) -> frozenset[str]:
    value = headers.get("Connection")
    if not value:
        return frozenset()
    return frozenset(t.strip().lower() for t in value.split(","))


def _end_to_end(headers: Mapping[str, str], also_drop: frozenset[str]) -> Iterable[tuple[str, str]]:
    listed = _connection_listed(headers)
    for k, v in headers.items():
        low = k.lower()
        if low in _HOP_BY_HOP or low.startswith("proxy-") or low in also_drop or (listed and low in listed):
            continue
        yield k, v


def openai_upstream_headers(headers: Mapping[str, str], request_id: str) -> CIMultiDict[str]:
    """Headers sent to the instance for an OpenAI request: the client's end-to-end
    headers (including ``Authorization``, which an engine run with ``--api-key`` needs),
    ``X-Request-Id``, and ``Accept-Encoding: identity`` unless the client chose one (we
    relay bytes undecoded, so the client must be able to read what the engine sends).
    ``Content-Encoding`` is dropped: aiohttp has already decoded a compressed request
    body, and the decoded bytes are what we forward."""
    out = CIMultiDict(_end_to_end(headers, _DROP_UPSTREAM))
    out[REQUEST_ID] = request_id
    if "Accept-Encoding" not in out:
        out["Accept-Encoding"] = "identity"
    return out


def native_upstream_headers(headers: Mapping[str, str], request_id: str) -> CIMultiDict[str]:
    """Headers sent to the instance for a native invocation. Like SageMaker, only the
    API's own headers pass (``Content-Type``, ``Accept``, ``X-Amzn-SageMaker-*``); the
    caller's AWS signature does not reach the model."""
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in headers.items():
        low = k.lower()
        if low in ("content-type", "accept") or low.startswith("x-amzn-sagemaker-"):
            out.add(k, v)
    out[REQUEST_ID] = request_id
    out["Accept-Encoding"] = "identity"
    return out


def openai_response_headers(upstream: Mapping[str, str]) -> CIMultiDict[str]:
    """The instance's end-to-end response headers, minus the ones the router sets."""
    return CIMultiDict(_end_to_end(upstream, _OURS))


def native_response_headers(upstream: Mapping[str, str]) -> CIMultiDict[str]:
    """What SageMaker returns of the model's headers: ``Content-Type`` and
    ``X-Amzn-SageMaker-*`` (custom attributes, session ids)."""
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in upstream.items():
        low = k.lower()
        if low == "content-type" or low.startswith("x-amzn-sagemaker-"):
            out.add(k, v)
    return out
