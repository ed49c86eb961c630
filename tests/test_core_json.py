"""The request-body parser: orjson's result, faster (simdjson) for the usual body."""

import json

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute.core import keys
from prefixroute.core.keys import SIMDJSON_MAX_BYTES, loads_body

# JSON values (floats that JSON can write; integers within orjson's 64 bits).
_scalar = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | \
    st.floats(allow_nan=False, allow_infinity=False) | st.text()
_json = st.recursive(_scalar, lambda inner: st.lists(inner, max_size=5) |
                     st.dictionaries(st.text(max_size=8), inner, max_size=5), max_leaves=30)


def _outcome(parse, body):
    try:
        return "ok", parse(body)
    except orjson.JSONDecodeError:
        return "error", None


@settings(max_examples=300, deadline=None)
@given(value=st.dictionaries(st.text(max_size=8), _json, max_size=6))
def test_an_object_parses_to_what_orjson_gives(value):
    for body in (orjson.dumps(value), json.dumps(value, indent=1, ensure_ascii=True).encode()):
        got = loads_body(body)
        assert got == orjson.loads(body) and type(got) is dict
        assert repr(got) == repr(orjson.loads(body))  # (ints stay ints, 1.0 stays a float, -0.0 its sign)


@settings(max_examples=500, deadline=None)
@given(data=st.data())
def test_a_damaged_body_is_refused_or_read_exactly_as_orjson_does(data):
    body = bytearray(orjson.dumps(data.draw(st.dictionaries(st.text(max_size=6), _json, min_size=1, max_size=4))))
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(body) - 1))
        kind = data.draw(st.sampled_from(["set", "delete", "insert"]))
        byte = data.draw(st.sampled_from(b'{}[]",:\\ -0.5eE+tfnul\x00\x1f\xff\xc3\xa9\t\n'))
        if kind == "set":
            body[i] = byte
        elif kind == "delete" and len(body) > 1:
            del body[i]
        else:
            body.insert(i, byte)
    assert _outcome(loads_body, bytes(body)) == _outcome(orjson.loads, bytes(body))


@pytest.mark.parametrize("body", [
    b"\xef\xbb\xbf{}",                              # a byte order mark: orjson refuses it
    b'{"seed": 123456789012345678901234567890}',    # beyond 64 bits: orjson reads a float
    b'{"a": -9223372036854775809}',
    b"", b"  ", b"{", b'{"a": 1}x', b'{"a": NaN}', b'{"a": 1e400}', b'{"a": "\\ud800"}', b'{"a": "\x01"}',
    b'{"a": "\xff"}', b"[" * 2000 + b"]" * 2000,
    b"[1, 2]", b'"text"', b"17", b"null",          # not objects: orjson's value
])
def test_what_simdjson_and_orjson_read_differently_is_orjson_s_to_decide(body):
    assert _outcome(loads_body, body) == _outcome(orjson.loads, body)


def test_the_error_is_orjson_s_and_names_the_position():
    with pytest.raises(orjson.JSONDecodeError, match=r"line 1 column 8 \(char 7\)"):
        loads_body(b'{"a": 1x}')


class _Refusing:
    """A stand-in parser that records the sizes it is given and refuses everything."""

    def __init__(self):
        self.sizes = []

    def parse(self, body):
        self.sizes.append(len(body))
        raise ValueError("refused")


def test_a_body_over_the_limit_is_read_by_orjson_alone(monkeypatch):
    spy = _Refusing()
    monkeypatch.setattr(keys, "_PARSER", spy)
    big = orjson.dumps({"messages": [{"role": "user", "content": "x" * SIMDJSON_MAX_BYTES}]})
    assert loads_body(big) == orjson.loads(big) and spy.sizes == []
    small = orjson.dumps({"a": "x"})
    assert loads_body(small) == {"a": "x"} and spy.sizes == [len(small)]  # refused: orjson's value


def test_without_pysimdjson_orjson_reads_every_body(monkeypatch):
    monkeypatch.setattr(keys, "_PARSER", None)  # (Python 3.14 and later: not installed)
    assert loads_body(b'{"a": [1, 2.5, "\\u00e9"]}') == {"a": [1, 2.5, "é"]}
    with pytest.raises(orjson.JSONDecodeError, match="line 1 column 8"):
        loads_body(b'{"a": 1x}')


def test_the_parser_is_reused_after_errors_and_other_values():
    for body in (b"{", b"[1, 2]", b'{"a": 123456789012345678901234567890}', b"\xef\xbb\xbf{}"):
        _outcome(loads_body, body)
    for i in range(3):  # still parses (and gives independent dicts)
        assert loads_body(orjson.dumps({"i": i, "s": "é" * i})) == {"i": i, "s": "é" * i}
