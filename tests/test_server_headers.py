"""The header helpers of the fast data plane against the reference functions they
stand in for: ``RawHeaderView`` reads what a ``CIMultiDict`` reads, and
``openai_upstream_lines`` writes exactly what the reference rules produce."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute.server import headers as H

# Names that matter to the rules (hop-by-hop, dropped, Proxy-*, Accept-Encoding, ours),
# in varied case, plus arbitrary token names.
_NAMES = st.sampled_from([
    b"Host", b"Content-Length", b"Content-Type", b"Connection", b"connection", b"Keep-Alive", b"TE",
    b"Transfer-Encoding", b"Upgrade", b"Proxy-Authorization", b"proxy-foo", b"X-Request-Id", b"x-request-id",
    b"Content-Encoding", b"Accept-Encoding", b"accept-encoding", b"Authorization", b"X-Custom", b"x-custom",
    b"Trailer", b"Expect", b"Close", b"close", b"X-Amzn-SageMaker-Target-Variant", b"Content-Digest", b"content-md5",
]) | st.from_regex(rb"\A[A-Za-z][A-Za-z0-9-]{0,12}\Z", fullmatch=True)
_CONNECTION_VALUES = st.sampled_from([b"keep-alive", b"close", b"Keep-Alive, TE", b"x-custom", b"upgrade, X-Custom",
                                      b" keep-alive , te ", b""])
_VALUES = st.binary(min_size=0, max_size=12).filter(lambda v: b"\r" not in v and b"\n" not in v)


@st.composite
def _headers(draw: st.DrawFn) -> list[tuple[bytes, bytes]]:
    out = []
    for name in draw(st.lists(_NAMES, max_size=10)):
        value = draw(_CONNECTION_VALUES) if name.lower() == b"connection" else draw(_VALUES)
        out.append((name, value))
    return out


@settings(max_examples=400, deadline=None)
@given(_headers(), st.sampled_from([None, "", "s3cret"]),
       st.sampled_from(["0123456789abcdef0123456789abcdef", "req-1"]), st.booleans())
def test_openai_upstream_lines_are_the_reference_rules_formatted(headers, token, rid, decoded):
    expected = H.header_lines(H.strip_secrets(H.openai_upstream_headers(headers, rid, decoded), token))
    assert H.openai_upstream_lines(headers, rid, token, decoded) == expected


def test_openai_upstream_lines_drop_what_connection_names_and_strip_the_admin_token():
    raw = [(b"Host", b"r:1"), (b"Connection", b"keep-alive, X-Custom"), (b"X-Custom", b"1"),
           (b"Authorization", b"Bearer s3cret"), (b"Content-Type", b"application/json")]
    assert H.openai_upstream_lines(raw, "r1", "s3cret") == (
        b"Content-Type: application/json\r\nX-Request-Id: r1\r\nAccept-Encoding: identity\r\n")
    assert H.openai_upstream_lines(raw, "r1") == (
        b"Authorization: Bearer s3cret\r\nContent-Type: application/json\r\nX-Request-Id: r1\r\n"
        b"Accept-Encoding: identity\r\n")
    assert H.openai_upstream_lines([(b"Accept-Encoding", b"gzip")], "r2") == (
        b"Accept-Encoding: gzip\r\nX-Request-Id: r2\r\n")


@settings(max_examples=300, deadline=None)
@given(_headers(), _NAMES)
def test_raw_header_view_reads_as_a_cimultidict(headers, probe):
    view = H.RawHeaderView(headers)
    ref = H.to_multidict(headers)
    name = probe.decode("latin-1")
    for n in (name, name.upper(), name.lower()):
        assert view.get(n) == ref.get(n)
        assert (n in view) == (n in ref)
        if n in ref:
            assert view[n] == ref[n]
    assert len(view) == len(ref)
    assert list(view) == [k.decode("latin-1") for k, _ in headers]
    assert view.get("X-Not-There-At-All", "default") == "default"


@settings(max_examples=300, deadline=None)
@given(_headers() | st.lists(st.sampled_from([(b"Date", b"x"), (b"Server", b"uvicorn"), (b"X-Request-Id", b"up"),
                                              (b"X-Prefixroute-Instance", b"i"), (b"Content-Type", b"a/b"),
                                              (b"Connection", b"close"), (b"X-Other", b"1")]), max_size=6))
def test_openai_response_lines_are_the_reference_rules_formatted(headers):
    assert H.openai_response_lines(headers) == H.header_lines(H.openai_response_headers(headers))


def test_the_admin_token_is_stripped_whatever_the_case_of_its_scheme():
    raw = [(b"Authorization", b"bearer s3cret"), (b"X-A", b"BEARER s3cret"), (b"X-B", b"Bearer   s3cret "),
           (b"X-C", b"s3cret"), (b"X-D", b"Basic s3cret"), (b"X-E", b"bearer other")]
    assert H.strip_secrets(raw, "s3cret") == [(b"X-D", b"Basic s3cret"), (b"X-E", b"bearer other")]
    assert H.openai_upstream_lines(raw, "r", "s3cret") == (
        b"X-D: Basic s3cret\r\nX-E: bearer other\r\nX-Request-Id: r\r\nAccept-Encoding: identity\r\n")
